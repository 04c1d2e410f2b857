#include "m3msa/testing/checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"

namespace m3msa::testkit {

void CheckResult::merge(const CheckResult& other) {
  if (name.empty()) name = other.name;
  checked += other.checked;
  if (other.failed > 0 && failed == 0) detail = other.detail;
  if (failed == 0 && other.failed == 0 && other.worst >= worst) detail = other.detail;
  failed += other.failed;
  worst = std::max(worst, other.worst);
}

std::string coordinates(const TensorView& view, int64_t index) {
  std::vector<int64_t> coords(static_cast<std::size_t>(view.ndim));
  for (int d = view.ndim - 1; d >= 0; --d) {
    const int64_t extent = std::max<int64_t>(view.shape[d], 1);
    coords[static_cast<std::size_t>(d)] = index % extent;
    index /= extent;
  }
  return shape_string(coords);
}

namespace {

std::string list_string(const int32_t* values, int n) {
  std::string out = "[";
  for (int i = 0; i < n; ++i) {
    if (i) out += ' ';
    out += std::to_string(values[i]);
  }
  return out + "]";
}

// The expected list (ascending forced blocks first) of a live row.
std::vector<int32_t> forced_blocks(int64_t nb, const SparseConfig& config) {
  std::vector<int32_t> out;
  for (int64_t b = 0; b < nb; ++b) {
    if (is_forced_block(b, nb, config.init_blocks, config.local_blocks)) {
      out.push_back(static_cast<int32_t>(b));
    }
  }
  return out;
}

float element_as_float(const TensorView& view, int64_t i) {
  switch (view.dtype) {
    case DType::kBF16: return bf16_to_float(view.ptr<uint16_t>()[i]);
    case DType::kFP8E4M3: return fp8e4m3_to_float(view.ptr<uint8_t>()[i]);
    case DType::kF32: return view.ptr<float>()[i];
    default:
      M3MSA_THROW(ErrorCode::kUnsupported, "compare_values: dtype ", dtype_name(view.dtype),
                  " is not a floating type");
  }
}

// One unit in the last place of `dtype` at magnitude |x| (x finite).
double ulp_at(DType dtype, float x) {
  const float magnitude = std::max(std::fabs(x), kUlpFloor);
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = m * 2^exponent, m in [0.5, 1)
  const int mantissa_bits = dtype == DType::kBF16 ? 7 : dtype == DType::kFP8E4M3 ? 3 : 23;
  return std::ldexp(1.0, exponent - 1 - mantissa_bits);
}

}  // namespace

CheckResult check_selections_wellformed(const SparseConfig& config, const BatchMeta& batch,
                                        const TensorView& topk_idx) {
  check_tensor(topk_idx, "topk_idx", DType::kI32,
               {batch.num_rows(), config.index_heads, config.topk});
  CheckResult result;
  result.name =
      "selections well-formed (a prefix of min(k, nb) distinct visible blocks, the "
      "forced blocks first, then -1; dead rows all -1)";
  const std::vector<RowPosition> rows = row_positions(batch);
  const int k = config.topk;
  std::vector<char> seen;
  for (std::size_t row = 0; row < rows.size(); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, config.block_size);
    const int64_t n = std::min<int64_t>(k, nb);
    const std::vector<int32_t> forced = forced_blocks(nb, config);
    for (int h = 0; h < config.index_heads; ++h) {
      const int32_t* list =
          topk_idx.ptr<int32_t>() + (static_cast<int64_t>(row) * config.index_heads + h) * k;
      ++result.checked;
      std::string problem;
      seen.assign(static_cast<std::size_t>(std::max<int64_t>(nb, 1)), 0);
      for (int i = 0; i < k && problem.empty(); ++i) {
        if (i >= n) {
          if (list[i] != -1) problem = fmt::format("entry {} is {}, expected -1", i, list[i]);
        } else if (list[i] < 0 || list[i] >= nb) {
          problem = fmt::format("entry {} is {}, not a visible block in [0, {})", i, list[i], nb);
        } else if (seen[static_cast<std::size_t>(list[i])]++) {
          problem = fmt::format("block {} appears twice", list[i]);
        } else if (static_cast<std::size_t>(i) < forced.size() &&
                   list[i] != forced[static_cast<std::size_t>(i)]) {
          problem = fmt::format("entry {} is {}, expected forced block {}", i, list[i],
                                forced[static_cast<std::size_t>(i)]);
        }
      }
      if (!problem.empty()) {
        if (result.failed++ == 0) {
          result.detail = fmt::format("row {} (pos {}, nb {}) head {}: {}: {}", row, rows[row].pos,
                                      nb, h, problem, list_string(list, k));
        }
      }
    }
  }
  return result;
}

CheckResult check_selections_vs_scores(const SparseConfig& config, const IndexerArgs& args,
                                       double tie_tolerance, int threads, const TensorView& want) {
  if (want.defined()) {
    check_tensor(want, "want", DType::kI32,
                 {args.batch.num_rows(), config.index_heads, config.topk});
  }
  CheckResult result;
  result.name = tie_tolerance == 0
                    ? "selections are exactly the top-k of the recomputed block scores "
                      "(cpu::score_blocks, docs/spec.md section 4 keys)"
                    : "selections match the top-k of the CPU reference scores (up to swaps of "
                      "near-tied blocks)";
  const std::vector<RowPosition> rows = row_positions(args.batch);
  int64_t max_nb = 1;
  for (const RowPosition& row : rows) {
    max_nb = std::max(max_nb, visible_blocks(row.pos, config.block_size));
  }
  const int H = config.index_heads;
  const int k = config.topk;
  HostTensor scores(DType::kF32, {static_cast<int64_t>(rows.size()), H, max_nb});
  cpu::score_blocks(config, args, scores.view(), threads);

  std::vector<uint64_t> keys;
  for (std::size_t row = 0; row < rows.size(); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, config.block_size);
    const int64_t n = std::min<int64_t>(k, nb);
    for (int h = 0; h < H; ++h) {
      ++result.checked;
      const float* s = scores.ptr<float>() + (static_cast<int64_t>(row) * H + h) * max_nb;
      const int32_t* got = args.topk_idx.ptr<int32_t>() + (static_cast<int64_t>(row) * H + h) * k;
      keys.clear();
      for (int64_t b = 0; b < nb; ++b) {
        const bool forced = is_forced_block(b, nb, config.init_blocks, config.local_blocks);
        keys.push_back(forced ? forced_key(static_cast<uint32_t>(b))
                              : scored_key(s[b], static_cast<uint32_t>(b)));
      }
      std::partial_sort(keys.begin(), keys.begin() + n, keys.end(), std::greater<>());
      std::vector<int32_t> reference(static_cast<std::size_t>(k), -1);
      for (int64_t i = 0; i < n; ++i) reference[static_cast<std::size_t>(i)] = key_block(keys[i]);
      const float kth = n > 0 ? s[reference[static_cast<std::size_t>(n - 1)]] : 0.0f;
      std::vector<int32_t> want_list = reference;
      if (want.defined()) {
        const int32_t* w = want.ptr<int32_t>() + (static_cast<int64_t>(row) * H + h) * k;
        want_list.assign(w, w + k);
      }

      std::string problem;
      if (tie_tolerance == 0) {
        if (!std::equal(want_list.begin(), want_list.end(), got)) {
          problem =
              fmt::format("got {}, want {}", list_string(got, k), list_string(want_list.data(), k));
        }
      } else {
        // Sets, with swaps allowed only among near-ties of the k-th score.
        std::vector<int32_t> a(got, got + n), b(want_list.begin(), want_list.begin() + n);
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        std::vector<int32_t> diff;
        std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(),
                                      std::back_inserter(diff));
        if (!diff.empty() && n > 0) {
          const double tol = tie_tolerance * std::max(1.0, std::fabs(static_cast<double>(kth)));
          for (int32_t block : diff) {
            const bool valid = block >= 0 && block < nb;
            const bool forced =
                valid && is_forced_block(block, nb, config.init_blocks, config.local_blocks);
            if (!valid || forced || !near_tie(s[block], kth, tie_tolerance)) {
              problem = fmt::format(
                  "block {} differs (score {}, k-th score {}, tolerance {}): "
                  "got {}, want {}",
                  block, valid ? s[block] : NAN, kth, tol, list_string(got, k),
                  list_string(want_list.data(), k));
              break;
            }
          }
        }
      }
      if (!problem.empty() && result.failed++ == 0) {
        result.detail =
            fmt::format("row {} (pos {}, nb {}) head {}: {}", row, rows[row].pos, nb, h, problem);
      }
    }
  }
  return result;
}

CheckResult compare_values(const std::string& name, const TensorView& got, const TensorView& want,
                           double max_ulps, const std::function<bool(int64_t)>& include) {
  M3MSA_CHECK_ARG(got.dtype == want.dtype && got.sizes() == want.sizes(), name, ": cannot compare ",
                  describe(got), " with ", describe(want));
  CheckResult result;
  result.name = name;
  const int64_t n = got.numel();
  int64_t worst_index = -1;
  int64_t first_bad = -1;
  // The magnitude floor: the RMS of the reference (see kUlpFloor), computed at the first element
  // whose bits differ (identical tensors, e.g. untouched cache pages, never pay for it).
  float floor = -1.0f;
  auto magnitude_floor = [&] {
    if (floor < 0) {
      double sum_squares = 0;
      int64_t finite = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float w = element_as_float(want, i);
        if (std::isfinite(w)) {
          sum_squares += static_cast<double>(w) * w;
          ++finite;
        }
      }
      floor = std::max(
          kUlpFloor,
          finite ? static_cast<float>(std::sqrt(sum_squares / static_cast<double>(finite))) : 0.0f);
    }
    return floor;
  };
  const std::size_t item = dtype_size(got.dtype);
  const auto* got_bytes = static_cast<const uint8_t*>(got.data);
  const auto* want_bytes = static_cast<const uint8_t*>(want.data);
  constexpr int64_t kChunk = 4096;
  for (int64_t i = 0; i < n; ++i) {
    // Whole chunks of identical bytes are skipped at memcmp speed (caches are mostly untouched).
    if (!include && i % kChunk == 0) {
      const int64_t len = std::min(kChunk, n - i);
      if (std::memcmp(got_bytes + i * item, want_bytes + i * item,
                      static_cast<std::size_t>(len) * item) == 0) {
        if (worst_index < 0) worst_index = i;
        result.checked += len;
        i += len - 1;
        continue;
      }
    }
    if (include && !include(i)) continue;
    ++result.checked;
    if (std::memcmp(got_bytes + i * item, want_bytes + i * item, item) == 0) {
      if (worst_index < 0) worst_index = i;
      continue;  // identical bits (the common case): error 0
    }
    const float g = element_as_float(got, i);
    const float w = element_as_float(want, i);
    double error = 0;
    if (std::isnan(w) || std::isnan(g) || std::isinf(w) || std::isinf(g)) {
      const bool same = (std::isnan(w) && std::isnan(g)) || (g == w);
      error = same ? 0.0 : INFINITY;
    } else {
      error = std::fabs(static_cast<double>(g) - w) /
              ulp_at(got.dtype, std::max(std::fabs(w), magnitude_floor()));
    }
    if (worst_index < 0 || error > result.worst) {
      result.worst = error;
      worst_index = i;
    }
    if (error > max_ulps) {
      if (first_bad < 0) first_bad = i;
      ++result.failed;
    }
  }
  if (worst_index >= 0) {
    result.detail =
        fmt::format("worst {:.2g} ulp at {}: got {:.6g}, want {:.6g} (limit {} ulp)", result.worst,
                    coordinates(got, worst_index), element_as_float(got, worst_index),
                    element_as_float(want, worst_index), max_ulps);
    if (first_bad >= 0) {
      result.detail += fmt::format("; first failure at {}", coordinates(got, first_bad));
    }
  }
  return result;
}

CheckResult compare_exact(const std::string& name, const TensorView& got, const TensorView& want) {
  M3MSA_CHECK_ARG(got.dtype == want.dtype && got.sizes() == want.sizes(), name, ": cannot compare ",
                  describe(got), " with ", describe(want));
  CheckResult result;
  result.name = name;
  const int64_t n = got.numel();
  const std::size_t item = dtype_size(got.dtype);
  const auto* a = static_cast<const uint8_t*>(got.data);
  const auto* b = static_cast<const uint8_t*>(want.data);
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * item, b + i * item, item) != 0) {
      if (result.failed++ == 0) {
        std::string g, w;
        if (got.dtype == DType::kI32) {
          g = std::to_string(got.ptr<int32_t>()[i]);
          w = std::to_string(want.ptr<int32_t>()[i]);
        } else if (got.dtype == DType::kI64) {
          g = std::to_string(got.ptr<int64_t>()[i]);
          w = std::to_string(want.ptr<int64_t>()[i]);
        } else if (got.dtype == DType::kBF16 || got.dtype == DType::kFP8E4M3 ||
                   got.dtype == DType::kF32) {
          g = fmt::format("{:g}", element_as_float(got, i));
          w = fmt::format("{:g}", element_as_float(want, i));
        } else {
          g = "(bytes differ)";
          w = "(other bytes)";
        }
        result.detail =
            fmt::format("first mismatch at {}: got {}, want {}", coordinates(got, i), g, w);
      }
    }
  }
  result.checked = n;
  return result;
}

int64_t compare_selection_near_tie(const SparseConfig& sc, const std::vector<int32_t>& got,
                                   const std::vector<int32_t>& want, const HostTensor& scores,
                                   const BatchMeta& batch, std::vector<bool>& swapped,
                                   std::string& first) {
  const int H = sc.index_heads;
  const int k = sc.topk;
  const int64_t cols = scores.shape()[2];
  const std::vector<RowPosition> rows = row_positions(batch);
  int64_t failures = 0;
  auto fail = [&](const std::string& what) {
    if (failures++ == 0) first = what;
  };
  for (int64_t row = 0; row < static_cast<int64_t>(rows.size()); ++row) {
    const int64_t nb = visible_blocks(rows[static_cast<std::size_t>(row)].pos, sc.block_size);
    const int64_t expect = std::min<int64_t>(k, nb);
    for (int h = 0; h < H; ++h) {
      const int32_t* g = got.data() + (row * H + h) * k;
      const int32_t* c = want.data() + (row * H + h) * k;
      const float* s = scores.ptr<float>() + (row * H + h) * cols;
      std::set<int32_t> gs, cs;
      const std::string where =
          fmt::format("row {} (pos {}) head {}: ", row, rows[static_cast<std::size_t>(row)].pos, h);
      bool structure = true;
      for (int i = 0; i < k; ++i) {
        if (i < expect) {
          if (g[i] < 0 || g[i] >= nb || !gs.insert(g[i]).second) structure = false;
          cs.insert(c[i]);
        } else if (g[i] != -1) {
          structure = false;
        }
      }
      if (!structure) {
        fail(where + "malformed selection");
        continue;
      }
      if (gs == cs) continue;
      double kth = INFINITY;
      for (int32_t b : cs) {
        if (!is_forced_block(b, nb, sc.init_blocks, sc.local_blocks)) {
          kth = std::min<double>(kth, s[b]);
        }
      }
      bool near = std::isfinite(kth);
      for (int32_t b : gs) near = near && (cs.count(b) || near_tie(s[b], kth));
      for (int32_t b : cs) near = near && (gs.count(b) || near_tie(s[b], kth));
      if (near) {
        swapped[static_cast<std::size_t>(row)] = true;
      } else {
        fail(where + fmt::format("selections differ beyond a near tie (k-th score {})", kth));
      }
    }
  }
  return failures;
}

void compare_close(ValueCheck& check, const std::vector<uint16_t>& got,
                   const std::vector<uint16_t>& want, int64_t rows, int64_t cols, double abs_tol,
                   double rel_tol, const std::vector<bool>& skip, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!skip.empty() && skip[static_cast<std::size_t>(r)]) continue;
    for (int64_t i = 0; i < cols; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * cols + i);
      const double g = bf16_to_float(got[at]);
      const double w = bf16_to_float(want[at]);
      ++check.checked;
      check.differ += got[at] != want[at];
      const bool finite = std::isfinite(g) && std::isfinite(w);
      const double ratio = finite ? std::fabs(g - w) / (abs_tol + rel_tol * std::fabs(w)) : 1e30;
      if (ratio > 1.0 && check.bad++ == 0) {
        check.first = fmt::format("{} [row {}, col {}]: got {}, want {}", what, r, i, g, w);
      }
      if (finite) check.worst = std::max(check.worst, ratio);
    }
  }
}

void compare_rows_l2(ValueCheck& check, const std::vector<uint16_t>& got,
                     const std::vector<uint16_t>& want, int64_t rows, int64_t cols, double l2_tol,
                     double abs_cap, const std::vector<bool>& skip, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!skip.empty() && skip[static_cast<std::size_t>(r)]) continue;
    double err = 0.0;
    double norm = 0.0;
    bool row_bad = false;
    std::string why;
    for (int64_t i = 0; i < cols; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * cols + i);
      const double g = bf16_to_float(got[at]);
      const double w = bf16_to_float(want[at]);
      ++check.checked;
      check.differ += got[at] != want[at];
      if (!std::isfinite(g) || !std::isfinite(w) || std::fabs(g - w) > abs_cap) {
        if (!row_bad) why = fmt::format("[row {}, col {}]: got {}, want {}", r, i, g, w);
        row_bad = true;
        continue;
      }
      err += (g - w) * (g - w);
      norm += w * w;
    }
    const double ratio = std::sqrt(err / std::max(norm, 1e-30)) / l2_tol;
    if (!row_bad && ratio > 1.0) {
      row_bad = true;
      why = fmt::format("[row {}]: relative L2 error {:.3g}", r, ratio * l2_tol);
    }
    if (row_bad && check.bad++ == 0) check.first = what + " " + why;
    check.worst = std::max(check.worst, ratio);
  }
}

}  // namespace m3msa::testkit
