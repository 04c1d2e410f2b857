// Built only without nvcc: the CUDA CP indexer (cp_cuda.h) says that this build has no CUDA.
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"

namespace m3msa {

struct CudaCpIndexer::Impl {};

CudaCpIndexer::CudaCpIndexer(Communicator&, int, const SparseConfig&, const CudaCpConfig&) {
  M3MSA_THROW(ErrorCode::kUnsupported,
              "CudaCpIndexer: this build has no CUDA (configured without nvcc or with "
              "M3MSA_ENABLE_CUDA=OFF)");
}
CudaCpIndexer::~CudaCpIndexer() = default;
void CudaCpIndexer::select(int, const IndexerArgs&, void*) {}
void CudaCpIndexer::score(const IndexerArgs&, void*) {}
void CudaCpIndexer::exchange(int, const IndexerArgs&, void*) {}
void CudaCpIndexer::check(void*) {}
std::optional<CpTimeoutRecord> CudaCpIndexer::last_timeout() const {
  return std::nullopt;
}
std::optional<CudaCpFault> CudaCpIndexer::last_fault() const {
  return std::nullopt;
}
int CudaCpIndexer::rank() const {
  return 0;
}
const std::vector<int>& CudaCpIndexer::merged_heads() const {
  static const std::vector<int> none;
  return none;
}
CudaCpInfo CudaCpIndexer::info() const {
  return {};
}
uint32_t CudaCpIndexer::generation() const {
  return 0;
}

}  // namespace m3msa
