#include "m3msa/case_io.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "m3msa/error.h"
#include "m3msa/npy.h"

namespace m3msa {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

// Where each known tensor lives in a SyntheticCase.
struct TensorSlot {
  const char* name;
  HostTensor SyntheticCase::*member;
};

constexpr TensorSlot kSlots[] = {
    {"index_q", &SyntheticCase::index_q},
    {"q", &SyntheticCase::q},
    {"index_cache", &SyntheticCase::index_cache},
    {"kv_cache", &SyntheticCase::kv_cache},
    {"seq_lens", &SyntheticCase::seq_lens},
    {"cu_seqlens_q", &SyntheticCase::cu_seqlens_q},
    {"context_lens", &SyntheticCase::context_lens},
    {"index_block_table", &SyntheticCase::index_block_table},
    {"kv_block_table", &SyntheticCase::kv_block_table},
    {"slot_mapping", &SyntheticCase::slot_mapping},
    {"index_slot_mapping", &SyntheticCase::index_slot_mapping},
    {"positions", &SyntheticCase::positions},
};

json config_to_json(const SparseConfig& c) {
  return json{{"q_heads", c.q_heads},
              {"kv_heads", c.kv_heads},
              {"head_dim", c.head_dim},
              {"index_heads", c.index_heads},
              {"index_dim", c.index_dim},
              {"block_size", c.block_size},
              {"topk", c.topk},
              {"init_blocks", c.init_blocks},
              {"local_blocks", c.local_blocks},
              {"rope_dim", c.rope_dim},
              {"rope_theta", c.rope_theta},
              {"rms_eps", c.rms_eps}};
}

template <typename T>
void read_field(const json& object, const char* key, T& value) {
  if (object.contains(key)) value = object.at(key).get<T>();
}

SparseConfig config_from_json(const json& j) {
  SparseConfig c;
  read_field(j, "q_heads", c.q_heads);
  read_field(j, "kv_heads", c.kv_heads);
  read_field(j, "head_dim", c.head_dim);
  read_field(j, "index_heads", c.index_heads);
  read_field(j, "index_dim", c.index_dim);
  read_field(j, "block_size", c.block_size);
  read_field(j, "topk", c.topk);
  read_field(j, "init_blocks", c.init_blocks);
  read_field(j, "local_blocks", c.local_blocks);
  read_field(j, "rope_dim", c.rope_dim);
  read_field(j, "rope_theta", c.rope_theta);
  read_field(j, "rms_eps", c.rms_eps);
  for (const auto& [key, value] : j.items()) {
    static const char* known[] = {"q_heads",      "kv_heads",   "head_dim",   "index_heads",
                                  "index_dim",    "block_size", "topk",       "init_blocks",
                                  "local_blocks", "rope_dim",   "rope_theta", "rms_eps"};
    bool found = false;
    for (const char* name : known) found = found || key == name;
    M3MSA_CHECK_ARG(found, "config: unknown field '", key, "'");
  }
  return c;
}

const char* kind_name(BatchKind kind) {
  return kind == BatchKind::kDecode ? "decode" : "prefill";
}

}  // namespace

const std::vector<std::string>& case_tensor_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const TensorSlot& slot : kSlots) out.emplace_back(slot.name);
    return out;
  }();
  return names;
}

void save_case(const std::string& dir, const SyntheticCase& step,
               const std::vector<std::pair<std::string, TensorView>>& extra,
               const std::string& source, const std::string& backend) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  M3MSA_CHECK_ARG(!ec && fs::is_directory(dir), dir, ": cannot create the case directory (",
                  ec.message(), ")");
  json tensors = json::object();
  auto write = [&](const std::string& name, const TensorView& view) {
    const std::string file = name + ".npy";
    save_npy((fs::path(dir) / file).string(), view);
    tensors[name] =
        json{{"file", file}, {"dtype", dtype_name(view.dtype)}, {"shape", view.sizes()}};
  };
  for (const TensorSlot& slot : kSlots) {
    const HostTensor& tensor = step.*slot.member;
    if (!tensor.empty() || (!tensor.shape().empty() && tensor.numel() == 0)) {
      write(slot.name, tensor.view());
    }
  }
  for (const auto& [name, view] : extra) {
    for (const TensorSlot& slot : kSlots) {
      M3MSA_CHECK_ARG(name != slot.name, "save_case: extra tensor '", name,
                      "' has the name of a case tensor");
    }
    write(name, view);
  }
  const json doc = {
      {"format", "m3msa-case"},
      {"version", kCaseFormatVersion},
      {"source", source},
      {"backend", backend},
      {"config", config_to_json(step.config)},
      {"batch",
       {{"kind", kind_name(step.batch.kind)},
        {"num_reqs", step.batch.num_reqs},
        {"q_len", step.batch.q_len},
        {"num_tokens", step.batch.kind == BatchKind::kPrefill ? step.batch.num_tokens : 0}}},
      {"index_dtype", dtype_name(step.index_cache.dtype())},
      {"index_q_dtype", dtype_name(step.index_q.dtype())},
      {"kv_dtype", dtype_name(step.kv_cache.dtype())},
      {"kv_layout", kv_layout_name(step.kv_layout)},
      {"k_scale", step.k_scale},
      {"v_scale", step.v_scale},
      {"tensors", tensors},
  };
  const std::string path = (fs::path(dir) / "case.json").string();
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  out.close();
  M3MSA_CHECK(out.good(), ErrorCode::kInternal, path, ": write failed");
}

namespace {
// The shape of the main cache of a case in `layout` (pages free).
std::vector<int64_t> kv_cache_shape(KVLayout layout, const SparseConfig& cfg) {
  switch (layout) {
    case KVLayout::kVllm: return {-1, 2, cfg.block_size, cfg.kv_heads, cfg.head_dim};
    case KVLayout::kFlashInfer: return {-1, cfg.kv_heads, cfg.block_size, 2 * cfg.head_dim};
    case KVLayout::kOurs: break;
  }
  return {-1, cfg.kv_heads, 2, cfg.block_size, cfg.head_dim};
}
}  // namespace

LoadedCase load_case(const std::string& dir) {
  const std::string json_path = (fs::path(dir) / "case.json").string();
  M3MSA_CHECK_ARG(fs::is_directory(dir), dir, ": not a directory (expected a case directory ",
                  "with case.json and .npy files)");
  std::ifstream in(json_path);
  M3MSA_CHECK_ARG(in.good(), json_path, ": cannot open");

  LoadedCase loaded;
  SyntheticCase& c = loaded.step;
  json doc;
  std::map<std::string, DType> dtypes;  // logical dtype of each known tensor
  std::map<std::string, std::vector<int64_t>> shapes;
  json tensors = json::object();
  try {
    doc = json::parse(in);
    M3MSA_CHECK_ARG(doc.is_object(), "the top level must be an object");
    if (doc.contains("format")) {
      M3MSA_CHECK_ARG(doc.at("format").get<std::string>() == "m3msa-case",
                      "format must be \"m3msa-case\", got ", doc.at("format").dump());
    }
    int version = kCaseFormatVersion;
    read_field(doc, "version", version);
    M3MSA_CHECK_SUPPORTED(version == kCaseFormatVersion, "version ", version,
                          " is not supported (this build reads version ", kCaseFormatVersion, ")");
    read_field(doc, "source", loaded.source);
    read_field(doc, "backend", loaded.backend);
    c.config = doc.contains("config") ? config_from_json(doc.at("config")) : SparseConfig{};
    c.config.validate();

    M3MSA_CHECK_ARG(doc.contains("batch"), "missing field \"batch\"");
    const json& batch = doc.at("batch");
    const std::string kind = batch.value("kind", std::string("decode"));
    M3MSA_CHECK_ARG(kind == "decode" || kind == "prefill",
                    "batch.kind must be \"decode\" or \"prefill\", got \"", kind, "\"");
    c.batch.kind = kind == "decode" ? BatchKind::kDecode : BatchKind::kPrefill;
    c.batch.num_reqs = batch.at("num_reqs").get<int>();
    M3MSA_CHECK_ARG(c.batch.num_reqs >= 0, "batch.num_reqs must be >= 0, got ", c.batch.num_reqs);
    if (c.batch.kind == BatchKind::kDecode) {
      c.batch.q_len = batch.value("q_len", 1);
      M3MSA_CHECK_ARG(c.batch.q_len >= 1 && c.batch.q_len <= kMaxQueryLen,
                      "batch.q_len must be in [1, ", kMaxQueryLen, "], got ", c.batch.q_len);
    } else {
      c.batch.num_tokens = batch.value("num_tokens", int64_t{-1});  // -1: from cu_seqlens_q
    }
    const DType index_dtype =
        parse_dtype(doc.value("index_dtype", std::string("bf16")), "index_dtype");
    const DType kv_dtype = parse_dtype(doc.value("kv_dtype", std::string("bf16")), "kv_dtype");
    M3MSA_CHECK_ARG(index_dtype == DType::kBF16 || index_dtype == DType::kFP8E4M3,
                    "index_dtype must be bf16 or fp8_e4m3, got ", dtype_name(index_dtype));
    const DType index_q_dtype =
        parse_dtype(doc.value("index_q_dtype", std::string("bf16")), "index_q_dtype");
    M3MSA_CHECK_ARG(index_q_dtype == DType::kBF16 ||
                        (index_q_dtype == DType::kFP8E4M3 && index_dtype == DType::kFP8E4M3),
                    "index_q_dtype must be bf16, or fp8_e4m3 with index_dtype fp8_e4m3, got ",
                    dtype_name(index_q_dtype), " with index_dtype ", dtype_name(index_dtype));
    M3MSA_CHECK_ARG(kv_dtype == DType::kBF16 || kv_dtype == DType::kFP8E4M3,
                    "kv_dtype must be bf16 or fp8_e4m3, got ", dtype_name(kv_dtype));
    c.kv_layout = parse_kv_layout(doc.value("kv_layout", std::string("ours")), "kv_layout");
    c.k_scale = doc.value("k_scale", 1.0f);
    c.v_scale = doc.value("v_scale", 1.0f);
    if (doc.contains("tensors")) tensors = doc.at("tensors");
    M3MSA_CHECK_ARG(tensors.is_object(), "tensors must be an object (name -> entry)");

    const SparseConfig& cfg = c.config;
    const int64_t reqs = c.batch.num_reqs;
    const int64_t rows = c.batch.kind == BatchKind::kDecode ? reqs * c.batch.q_len : -1;
    dtypes = {{"index_q", index_q_dtype},          {"q", DType::kBF16},
              {"index_cache", index_dtype},        {"kv_cache", kv_dtype},
              {"seq_lens", DType::kI32},           {"cu_seqlens_q", DType::kI32},
              {"context_lens", DType::kI32},       {"index_block_table", DType::kI32},
              {"kv_block_table", DType::kI32},     {"slot_mapping", DType::kI64},
              {"index_slot_mapping", DType::kI64}, {"positions", DType::kI64}};
    shapes = {{"index_q", {rows, cfg.index_heads, cfg.index_dim}},
              {"q", {rows, cfg.q_heads, cfg.head_dim}},
              {"index_cache", {-1, cfg.block_size, cfg.index_dim}},
              {"kv_cache", kv_cache_shape(c.kv_layout, cfg)},
              {"seq_lens", {reqs}},
              {"cu_seqlens_q", {reqs + 1}},
              {"context_lens", {reqs}},
              {"index_block_table", {reqs, -1}},
              {"kv_block_table", {reqs, -1}},
              {"slot_mapping", {rows}},
              {"index_slot_mapping", {rows}},
              {"positions", {rows}}};
    for (const auto& [name, entry] : tensors.items()) {
      M3MSA_CHECK_ARG(entry.is_object() && entry.contains("file"), "tensors.", name,
                      " must be an object with a \"file\" field");
      if (entry.contains("dtype") && dtypes.count(name)) {
        const DType given = parse_dtype(entry.at("dtype").get<std::string>(), name.c_str());
        M3MSA_CHECK_ARG(
            given == dtypes[name], "tensors.", name, ".dtype is ", dtype_name(given), " but ", name,
            " must be ", dtype_name(dtypes[name]),
            name == "index_cache" || name == "kv_cache" ? " (see index_dtype / kv_dtype)" : "");
      }
    }
  } catch (const json::exception& e) {
    M3MSA_THROW(ErrorCode::kInvalidArgument, json_path, ": ", e.what());
  } catch (const Error& e) {
    if (e.message().rfind(json_path, 0) == 0) throw;
    throw Error(e.code(), json_path + ": " + e.message());
  }

  // The file of a tensor: its "tensors" entry, else NAME.npy if present.
  auto file_of = [&](const std::string& name) -> std::optional<std::string> {
    if (tensors.contains(name)) {
      const std::string file =
          (fs::path(dir) / tensors.at(name).at("file").get<std::string>()).string();
      M3MSA_CHECK_ARG(fs::exists(file), file, ": missing (", json_path, " lists it as tensor ",
                      name, ")");
      return file;
    }
    const fs::path guess = fs::path(dir) / (name + ".npy");
    if (fs::exists(guess)) return guess.string();
    return std::nullopt;
  };

  const bool decode = c.batch.kind == BatchKind::kDecode;
  std::vector<std::string> required = {
      "index_q", "q", "index_cache", "kv_cache", "index_block_table", "kv_block_table"};
  if (decode) {
    required.push_back("seq_lens");
  } else {
    required.push_back("cu_seqlens_q");
    required.push_back("context_lens");
  }
  // Prefill: the row count comes from cu_seqlens_q, so load it first.
  if (!decode) {
    const auto file = file_of("cu_seqlens_q");
    M3MSA_CHECK_ARG(file, json_path, ": the prefill case needs cu_seqlens_q (",
                    (fs::path(dir) / "cu_seqlens_q.npy").string(), " is missing)");
    c.cu_seqlens_q = load_npy(*file, DType::kI32, shapes["cu_seqlens_q"]);
    const int64_t tokens =
        c.batch.num_reqs >= 0 ? c.cu_seqlens_q.ptr<int32_t>()[c.batch.num_reqs] : 0;
    if (c.batch.num_tokens < 0) c.batch.num_tokens = tokens;
    M3MSA_CHECK_ARG(c.batch.num_tokens == tokens, json_path, ": batch.num_tokens (",
                    c.batch.num_tokens, ") differs from cu_seqlens_q[num_reqs] (", tokens, ")");
    for (const char* name : {"index_q", "q", "slot_mapping", "index_slot_mapping", "positions"}) {
      shapes[name][0] = c.batch.num_tokens;
    }
  }
  for (const TensorSlot& slot : kSlots) {
    const std::string name = slot.name;
    if (name == "cu_seqlens_q" && !decode) continue;
    const auto file = file_of(name);
    const bool needed = std::find(required.begin(), required.end(), name) != required.end();
    if (!file) {
      M3MSA_CHECK_ARG(!needed, json_path, ": the case needs tensor ", name, " (",
                      (fs::path(dir) / (name + ".npy")).string(), " is missing)");
      continue;
    }
    c.*slot.member = load_npy(*file, dtypes[name], shapes[name]);
  }
  for (const auto& [name, entry] : tensors.items()) {
    if (dtypes.count(name)) continue;
    const std::string file = (fs::path(dir) / entry.at("file").get<std::string>()).string();
    try {
      const DType dtype = parse_dtype(entry.value("dtype", std::string()), name.c_str());
      loaded.extra[name] = load_npy(file, dtype);
    } catch (const json::exception& e) {
      M3MSA_THROW(ErrorCode::kInvalidArgument, json_path, ": tensors.", name, ": ", e.what());
    }
  }

  auto view_or_none = [](const HostTensor& t) {
    return t.empty() && t.shape().empty() ? TensorView{} : t.view();
  };
  c.batch.seq_lens = view_or_none(c.seq_lens);
  c.batch.cu_seqlens_q = view_or_none(c.cu_seqlens_q);
  c.batch.context_lens = view_or_none(c.context_lens);
  c.batch.index_block_table = view_or_none(c.index_block_table);
  c.batch.kv_block_table = view_or_none(c.kv_block_table);
  c.batch.slot_mapping = view_or_none(c.slot_mapping);
  c.batch.index_slot_mapping = view_or_none(c.index_slot_mapping);
  return loaded;
}

}  // namespace m3msa
