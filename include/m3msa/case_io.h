// One captured step on disk, the input of `m3msa replay` (docs/replay.md):
//   DIR/case.json   config, batch kind, num_reqs, q_len / num_tokens, cache dtypes and scales, and
//                   which tensors there are (file, logical dtype, shape)
//   DIR/NAME.npy    one file per tensor (npy.h): index_q, q, index_cache, kv_cache, seq_lens
//                   (decode) or cu_seqlens_q + context_lens (prefill), index_block_table,
//                   kv_block_table, and optionally slot_mapping, index_slot_mapping, positions and
//                   any extra tensors (e.g. the expected outputs expected_topk_idx, expected_out).
// bf16 and fp8_e4m3 tensors are stored as their bit patterns (numpy uint16 / uint8) and their
// dtype is recorded in case.json. Every error names the file (and the JSON field) at fault.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "m3msa/synthetic.h"
#include "m3msa/tensor.h"

namespace m3msa {

inline constexpr int kCaseFormatVersion = 1;

struct LoadedCase {
  SyntheticCase step;                       // config, batch (views into the tensors), tensors
  std::map<std::string, HostTensor> extra;  // every other tensor listed in case.json
  std::string source;                       // free text: what produced the case
  std::string backend;  // the backend that computed any expected_* outputs ("" if unknown)
};

// Writes DIR/case.json and one .npy per tensor of `step` that is present (empty HostTensors are
// skipped), plus `extra` (name -> host tensor). `backend` names the backend that computed the
// extras (expected outputs), if any. Creates DIR if needed; overwrites existing files.
void save_case(const std::string& dir, const SyntheticCase& step,
               const std::vector<std::pair<std::string, TensorView>>& extra = {},
               const std::string& source = "", const std::string& backend = "");

// Reads DIR/case.json and the tensors it names. Fields of "config" that are absent take the M3
// defaults of SparseConfig; a tensor missing from "tensors" is looked for as DIR/NAME.npy. Shapes
// and dtypes are checked against the config and the batch; the contents (table entries, lengths)
// are not: use validate_batch_contents.
LoadedCase load_case(const std::string& dir);

// The names of the tensors a case may hold (in the order they are written).
const std::vector<std::string>& case_tensor_names();

}  // namespace m3msa
