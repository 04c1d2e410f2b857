// .npy reader/writer (npy.h) and the replay case files (case_io.h): round trips of every dtype,
// byte-exact numpy headers, and every malformed file rejected with an error naming the file.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "m3msa/case_io.h"
#include "m3msa/error.h"
#include "m3msa/npy.h"
#include "m3msa/synthetic.h"

namespace m3msa {
namespace {

namespace fs = std::filesystem;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           (std::string("m3msa_npy_") + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_bytes(const std::string& name, const std::string& bytes) const {
    std::ofstream out(path(name), std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  std::string read_bytes(const std::string& name) const {
    std::ifstream in(path(name), std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // A numpy-style file: preamble (version 1 or 2), dict padded to 64 bytes, then `data`.
  static std::string npy_bytes(const std::string& dict, const std::string& data, int version = 1) {
    const std::size_t preamble = version == 1 ? 10 : 12;
    std::string header = dict;
    const std::size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
    header.append(total - preamble - header.size() - 1, ' ');
    header += '\n';
    std::string out("\x93NUMPY", 6);
    out += static_cast<char>(version);
    out += '\0';
    out += static_cast<char>(header.size() & 0xFF);
    out += static_cast<char>((header.size() >> 8) & 0xFF);
    if (version == 2) out += std::string(2, '\0');
    return out + header + data;
  }

  // Expects an Error whose message names the file and contains `phrase`.
  template <typename F>
  void expect_error(F&& f, const std::string& file, const std::string& phrase) {
    try {
      f();
      ADD_FAILURE() << "no error for " << file << " (expected '" << phrase << "')";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(path(file)), std::string::npos)
          << "the message does not name the file: " << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos)
          << "expected '" << phrase << "' in: " << e.what();
    }
  }

  fs::path dir_;
};

template <typename T>
HostTensor filled(DType dtype, std::vector<int64_t> shape, T start) {
  HostTensor t(dtype, std::move(shape));
  T* data = t.ptr<T>();
  for (int64_t i = 0; i < t.numel(); ++i) data[i] = static_cast<T>(start + static_cast<T>(i * 7));
  return t;
}

void expect_same(const HostTensor& a, const HostTensor& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.shape(), b.shape());
  ASSERT_EQ(a.nbytes(), b.nbytes());
  if (a.nbytes()) {
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  }
}

TEST_F(NpyTest, RoundTripEveryDtype) {
  struct Case {
    HostTensor tensor;
    const char* descr;
  };
  std::vector<Case> cases;
  cases.push_back({filled<float>(DType::kF32, {3, 4}, -1.5f), "<f4"});
  cases.push_back({filled<uint16_t>(DType::kBF16, {2, 3, 5}, uint16_t{0x3F80}), "<u2"});
  cases.push_back({filled<uint8_t>(DType::kFP8E4M3, {17}, uint8_t{1}), "|u1"});
  cases.push_back({filled<uint8_t>(DType::kU8, {4, 1}, uint8_t{250}), "|u1"});
  cases.push_back({filled<int32_t>(DType::kI32, {2, 2, 2, 2}, -8), "<i4"});
  cases.push_back({filled<int64_t>(DType::kI64, {6}, int64_t{-1} << 40), "<i8"});
  cases.push_back({filled<uint64_t>(DType::kU64, {1, 3}, ~uint64_t{0} - 100), "<u8"});
  cases.push_back({HostTensor(DType::kI32, {0, 16}), "<i4"});  // empty
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.tensor.dtype())) + shape_string(c.tensor.shape()));
    const std::string file = path(std::string(dtype_name(c.tensor.dtype())) + ".npy");
    save_npy(file, c.tensor.view());
    const NpyHeader header = read_npy_header(file);
    EXPECT_EQ(header.descr, c.descr);
    EXPECT_EQ(header.shape, c.tensor.shape());
    EXPECT_EQ(header.data_offset % 64, 0u);
    expect_same(load_npy(file, c.tensor.dtype()), c.tensor);
    expect_same(load_npy(file, c.tensor.dtype(), c.tensor.shape()), c.tensor);
    const NpyArray raw = read_npy(file);
    EXPECT_EQ(raw.descr, c.descr);
    EXPECT_EQ(raw.data.size(), c.tensor.nbytes());
  }
}

TEST_F(NpyTest, WritesTheHeaderNumpyWrites) {
  // np.save("a.npy", np.zeros((3, 4), "<f4")) writes exactly this header (version 1.0, 128 bytes).
  std::vector<float> zeros(12, 0.0f);
  write_npy(path("a.npy"), "<f4", {3, 4}, zeros.data(), zeros.size() * 4);
  const std::string expected = npy_bytes(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", std::string(48, '\0'));
  EXPECT_EQ(read_bytes("a.npy"), expected);
  EXPECT_EQ(expected.size(), 128u + 48u);
  // One dimension: "(5,)".
  std::vector<uint8_t> bytes(5, 1);
  write_npy(path("b.npy"), "u1", {5}, bytes.data(), bytes.size());
  EXPECT_EQ(
      read_bytes("b.npy"),
      npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }", std::string(5, '\1')));
}

TEST_F(NpyTest, ReadsNumpyVariants) {
  // Version 2.0, "<u1", double quotes, no trailing comma, odd spacing, a scalar.
  write_bytes("v2.npy", npy_bytes("{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }",
                                  std::string("\x01\x00\x02\x00", 4), 2));
  const HostTensor v2 = load_npy(path("v2.npy"), DType::kBF16);
  ASSERT_EQ(v2.shape(), std::vector<int64_t>{2});
  EXPECT_EQ(v2.ptr<uint16_t>()[1], 2);
  EXPECT_EQ(read_npy_header(path("v2.npy")).version_major, 2);

  write_bytes("u1.npy", npy_bytes("{\"descr\":\"<u1\",\"fortran_order\":False,\"shape\":(1, 2)}",
                                  std::string("\x07\x08", 2)));
  const HostTensor u1 = load_npy(path("u1.npy"), DType::kFP8E4M3, {1, 2});
  EXPECT_EQ(u1.ptr<uint8_t>()[1], 8);

  float three = 3.0f;
  write_bytes("scalar.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                                      std::string(reinterpret_cast<const char*>(&three), 4)));
  const NpyArray scalar = read_npy(path("scalar.npy"));
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.numel(), 1);
  ASSERT_EQ(scalar.data.size(), 4u);
}

TEST_F(NpyTest, RejectsMalformedFiles) {
  const std::string good_dict = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }";
  const std::string data16(16, '\0');

  write_bytes("magic.npy", "\x93NUMPX" + npy_bytes(good_dict, data16).substr(6));
  expect_error([&] { read_npy(path("magic.npy")); }, "magic.npy", "bad magic");

  write_bytes("short.npy", "\x93NU");
  expect_error([&] { read_npy(path("short.npy")); }, "short.npy", "not a .npy file");

  std::string v3 = npy_bytes(good_dict, data16);
  v3[6] = 3;
  write_bytes("v3.npy", v3);
  expect_error([&] { read_npy(path("v3.npy")); }, "v3.npy", "version 3.0");

  write_bytes("fortran.npy",
              npy_bytes("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 2), }", data16));
  expect_error([&] { read_npy(path("fortran.npy")); }, "fortran.npy", "fortran_order True");

  write_bytes("truncated.npy", npy_bytes(good_dict, data16.substr(0, 12)));
  expect_error([&] { read_npy(path("truncated.npy")); }, "truncated.npy", "truncated data");
  expect_error([&] { load_npy(path("truncated.npy"), DType::kI32); }, "truncated.npy",
               "truncated data");

  write_bytes("trailing.npy", npy_bytes(good_dict, data16 + "xx"));
  expect_error([&] { read_npy(path("trailing.npy")); }, "trailing.npy", "trailing data");

  std::string cut_header = npy_bytes(good_dict, data16).substr(0, 40);
  write_bytes("cut_header.npy", cut_header);
  expect_error([&] { read_npy(path("cut_header.npy")); }, "cut_header.npy", "truncated header");

  write_bytes("f8.npy",
              npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", data16));
  expect_error([&] { read_npy(path("f8.npy")); }, "f8.npy", "unsupported dtype '<f8'");

  write_bytes("big.npy",
              npy_bytes("{'descr': '>i4', 'fortran_order': False, 'shape': (2, 2), }", data16));
  expect_error([&] { read_npy(path("big.npy")); }, "big.npy", "big-endian");

  write_bytes("nokey.npy", npy_bytes("{'descr': '<i4', 'shape': (2, 2), }", data16));
  expect_error([&] { read_npy(path("nokey.npy")); }, "nokey.npy", "fortran_order");

  write_bytes(
      "extra_key.npy",
      npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), 'x': 1}", data16));
  expect_error([&] { read_npy(path("extra_key.npy")); }, "extra_key.npy", "unexpected header key");

  write_bytes("neg.npy",
              npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (-2, 2), }", data16));
  expect_error([&] { read_npy(path("neg.npy")); }, "neg.npy", "malformed shape");

  write_bytes("garbage.npy",
              npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2)", data16));
  expect_error([&] { read_npy(path("garbage.npy")); }, "garbage.npy", "malformed header");

  // Well-formed files that are not what the caller expects.
  write_bytes("good.npy", npy_bytes(good_dict, data16));
  expect_error(
      [&] {
        load_npy(path("good.npy"), DType::kI32, {2, 3});
      },
      "good.npy", "shape mismatch");
  expect_error([&] { load_npy(path("good.npy"), DType::kI32, {4}); }, "good.npy", "shape mismatch");
  expect_error([&] { load_npy(path("good.npy"), DType::kI64); }, "good.npy", "expected dtype <i8");
  expect_error([&] { load_npy(path("missing.npy"), DType::kI32); }, "missing.npy", "cannot open");
  EXPECT_EQ(load_npy(path("good.npy"), DType::kI32, {-1, 2}).numel(), 4);
}

SyntheticCase small_case(BatchKind kind, DType index_dtype, DType kv_dtype) {
  SyntheticSpec spec;
  spec.config.q_heads = 8;
  spec.config.kv_heads = 2;
  spec.config.index_heads = 2;
  spec.config.head_dim = 32;
  spec.config.index_dim = 32;
  spec.config.rope_dim = 16;
  spec.config.block_size = 16;
  spec.config.topk = 4;
  spec.kind = kind;
  spec.num_reqs = 3;
  spec.q_len = 2;
  spec.min_context = 2;
  spec.max_context = 200;
  spec.padding_reqs = kind == BatchKind::kDecode ? 1 : 0;
  spec.index_dtype = index_dtype;
  spec.kv_dtype = kv_dtype;
  spec.k_scale = 0.5f;
  spec.v_scale = 2.0f;
  spec.seed = 7;
  return make_synthetic_case(spec);
}

TEST_F(NpyTest, CaseRoundTrip) {
  for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
    SCOPED_TRACE(kind == BatchKind::kDecode ? "decode" : "prefill");
    const SyntheticCase c = small_case(kind, DType::kFP8E4M3, DType::kBF16);
    HostTensor extra = filled<int32_t>(DType::kI32, {c.num_rows(), 2, 4}, 0);
    const std::string dir = path(kind == BatchKind::kDecode ? "decode" : "prefill");
    save_case(dir, c, {{"expected_topk_idx", extra.view()}}, "unit test", "cpu-reference");
    const LoadedCase loaded = load_case(dir);
    const SyntheticCase& l = loaded.step;
    EXPECT_EQ(loaded.source, "unit test");
    EXPECT_EQ(loaded.backend, "cpu-reference");
    EXPECT_EQ(l.config.to_string(), c.config.to_string());
    EXPECT_EQ(l.batch.kind, c.batch.kind);
    EXPECT_EQ(l.batch.num_reqs, c.batch.num_reqs);
    EXPECT_EQ(l.batch.num_rows(), c.batch.num_rows());
    EXPECT_EQ(l.k_scale, 0.5f);
    EXPECT_EQ(l.v_scale, 2.0f);
    expect_same(l.index_q, c.index_q);
    expect_same(l.q, c.q);
    expect_same(l.index_cache, c.index_cache);
    expect_same(l.kv_cache, c.kv_cache);
    expect_same(l.index_block_table, c.index_block_table);
    expect_same(l.kv_block_table, c.kv_block_table);
    expect_same(l.slot_mapping, c.slot_mapping);
    expect_same(l.index_slot_mapping, c.index_slot_mapping);
    expect_same(l.positions, c.positions);
    if (kind == BatchKind::kDecode) {
      expect_same(l.seq_lens, c.seq_lens);
      EXPECT_EQ(l.batch.q_len, 2);
    } else {
      expect_same(l.cu_seqlens_q, c.cu_seqlens_q);
      expect_same(l.context_lens, c.context_lens);
      EXPECT_EQ(l.batch.num_tokens, c.batch.num_tokens);
    }
    ASSERT_EQ(loaded.extra.count("expected_topk_idx"), 1u);
    expect_same(loaded.extra.at("expected_topk_idx"), extra);
    // The views point into the loaded tensors.
    EXPECT_EQ(l.batch.index_block_table.data, l.index_block_table.data());
    EXPECT_NO_THROW(validate_batch_contents(l.batch, l.config, l.index_cache.shape()[0],
                                            l.kv_cache.shape()[0]));
  }
}

TEST_F(NpyTest, CaseErrorsNameTheFile) {
  const SyntheticCase c = small_case(BatchKind::kDecode, DType::kBF16, DType::kBF16);
  const std::string dir = path("case");
  save_case(dir, c);
  // A missing tensor.
  fs::remove(fs::path(dir) / "q.npy");
  expect_error([&] { load_case(dir); }, "case/q.npy", "missing (");
  save_case(dir, c);
  // Without a "tensors" map, tensors are found as NAME.npy; a missing required one is named.
  {
    std::ifstream in(fs::path(dir) / "case.json");
    nlohmann::json doc = nlohmann::json::parse(in);
    doc.erase("tensors");
    std::ofstream(fs::path(dir) / "case.json") << doc.dump();
  }
  const LoadedCase by_name = load_case(dir);
  expect_same(by_name.step.kv_cache, c.kv_cache);
  EXPECT_TRUE(by_name.extra.empty());
  fs::remove(fs::path(dir) / "q.npy");
  expect_error([&] { load_case(dir); }, "case/q.npy", "needs tensor q");
  save_case(dir, c);
  // A tensor whose shape does not fit the config.
  HostTensor wrong(DType::kBF16, {c.num_rows(), 8, 16});
  save_npy((fs::path(dir) / "q.npy").string(), wrong.view());
  expect_error([&] { load_case(dir); }, "case/q.npy", "shape mismatch");
  save_case(dir, c);
  // A cache saved with a dtype other than the one case.json records.
  HostTensor wrong_dtype(DType::kFP8E4M3, c.index_cache.shape());
  wrong_dtype.fill_bytes(0);
  save_npy((fs::path(dir) / "index_cache.npy").string(), wrong_dtype.view());
  expect_error([&] { load_case(dir); }, "case/index_cache.npy", "expected dtype <u2");
  // Broken JSON and bad fields.
  std::ofstream(fs::path(dir) / "case.json") << "{ not json";
  expect_error([&] { load_case(dir); }, "case/case.json", "parse");
  std::ofstream(fs::path(dir) / "case.json") << R"({"batch": {"kind": "decode", "num_reqs": 2}, )"
                                             << R"("config": {"topk": 0}})";
  expect_error([&] { load_case(dir); }, "case/case.json", "config.topk");
  std::ofstream(fs::path(dir) / "case.json") << R"({"batch": {"kind": "chunked", "num_reqs": 2}})";
  expect_error([&] { load_case(dir); }, "case/case.json", "batch.kind");
  std::ofstream(fs::path(dir) / "case.json") << R"({"batch": {"num_reqs": 2}, "bogus_key": 1, )"
                                             << R"("config": {"top_k": 4}})";
  expect_error([&] { load_case(dir); }, "case/case.json", "unknown field 'top_k'");
  expect_error([&] { load_case(path("nowhere")); }, "nowhere", "not a directory");
}

}  // namespace
}  // namespace m3msa
