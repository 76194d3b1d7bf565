// IndexedDataset reads what megatron-core's IndexedDatasetBuilder wrote (tests/data/fixtures,
// by tools/write_megatron_fixture.py) exactly as megatron-core's IndexedDataset read it back;
// IndexedDatasetBuilder writes those files byte for byte; bad files are refused naming the file.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "dsp/data/indexed_dataset.hpp"
#include "fixture.hpp"

namespace data_indexed_dataset_test {

using data_test::expected;
using data_test::fixture;
using data_test::TempDir;
using dsp::data::IndexedDataset;
using dsp::data::IndexedDatasetBuilder;
using dsp::data::TokenDType;
namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// The message of the InputError f throws ("" and a failed check when it throws none).
template <class F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const dsp::InputError& e) {
    return e.what();
  }
  FAIL_CHECK("no InputError thrown");
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Everything megatron-core read back from a fixture equals what IndexedDataset reads.
void check_against_megatron(const IndexedDataset& ds, const nlohmann::json& e) {
  CHECK(static_cast<int>(ds.dtype()) == e["dtype_code"].get<int>());
  const auto lengths = e["sequence_lengths"].get<std::vector<std::int32_t>>();
  const auto pointers = e["sequence_pointers"].get<std::vector<std::int64_t>>();
  const auto doc_idx = e["document_indices"].get<std::vector<std::int64_t>>();
  const auto sequences = e["sequences"].get<std::vector<std::vector<std::int64_t>>>();
  REQUIRE(ds.sequence_count() == static_cast<std::int64_t>(lengths.size()));
  CHECK(ds.document_count() == static_cast<std::int64_t>(doc_idx.size()) - 1);
  CHECK(ds.sequence_lengths() == lengths);
  CHECK(ds.document_indices() == doc_idx);
  for (std::int64_t i = 0; i < ds.sequence_count(); ++i) {
    CAPTURE(i);
    CHECK(ds.sequence_pointer(i) == pointers[static_cast<std::size_t>(i)]);
    const auto& want = sequences[static_cast<std::size_t>(i)];
    CHECK(ds.sequence(i) == std::vector<std::int32_t>(want.begin(), want.end()));
  }
  for (std::int64_t d = 0; d < ds.document_count(); ++d) {
    const auto [first, last] = ds.document(d);
    CHECK(first == doc_idx[static_cast<std::size_t>(d)]);
    CHECK(last == doc_idx[static_cast<std::size_t>(d) + 1]);
  }
}

/// Writes the sequences and documents of a megatron-core read-back with IndexedDatasetBuilder.
void build_like(const nlohmann::json& e, const std::string& prefix, TokenDType dtype, bool multimodal) {
  const auto sequences = e["sequences"].get<std::vector<std::vector<std::int64_t>>>();
  const auto doc_idx = e["document_indices"].get<std::vector<std::int64_t>>();
  const auto modes = multimodal ? e["sequence_modes"].get<std::vector<std::int8_t>>() : std::vector<std::int8_t>{};
  IndexedDatasetBuilder b(prefix, dtype, multimodal);
  std::size_t doc = 1;
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    b.add_item(sequences[i], multimodal ? modes[i] : std::int8_t{0});
    while (doc < doc_idx.size() && doc_idx[doc] == static_cast<std::int64_t>(i) + 1) {
      b.end_document();
      ++doc;
    }
  }
  b.finalize();
}

TEST_CASE("the tiny-Shakespeare fixture reads as megatron-core read it (uint16, 23 documents of lines)") {
  const IndexedDataset ds(fixture("megatron_shakespeare"));
  const auto& e = expected()["shakespeare"];
  check_against_megatron(ds, e);
  CHECK(ds.dtype() == TokenDType::uint16);
  CHECK_FALSE(ds.has_sequence_modes());
  CHECK(ds.sequence_modes().empty());
  // typed access: the stored uint16 tokens; every document ends with the EOD token
  const int eod = expected()["eod"].get<int>();
  for (std::int64_t d = 0; d < ds.document_count(); ++d) {
    const auto [first, last] = ds.document(d);
    REQUIRE(last > first);
    const auto tail = ds.typed_sequence<std::uint16_t>(last - 1);
    CHECK(tail.back() == eod);
  }
  CHECK(ds.typed_sequence<std::uint16_t>(0)[0] == 'F');  // "First Citizen:"
  // a window of a sequence, as IndexedDataset.get(i, offset, length)
  std::vector<std::int32_t> part;
  ds.read(0, part, 6, 7);
  CHECK(std::string(part.begin(), part.end()) == "Citizen");
  CHECK_THROWS_AS(ds.read(0, part, 10, 100), dsp::InputError);
  CHECK_THROWS_AS(ds.typed_sequence<std::int32_t>(0), dsp::InputError);
  CHECK_THROWS_AS(ds.sequence(ds.sequence_count()), dsp::InputError);
  CHECK_THROWS_AS(ds.document(ds.document_count()), dsp::InputError);
}

TEST_CASE("the multimodal int32 fixture reads with its modes, its extreme and empty sequences") {
  const IndexedDataset ds(fixture("megatron_modes"));
  const auto& e = expected()["modes"];
  check_against_megatron(ds, e);
  CHECK(ds.dtype() == TokenDType::int32);
  REQUIRE(ds.has_sequence_modes());
  const auto modes = e["sequence_modes"].get<std::vector<std::int8_t>>();
  CHECK(std::vector<std::int8_t>(ds.sequence_modes().begin(), ds.sequence_modes().end()) == modes);
}

TEST_CASE("IndexedDatasetBuilder writes megatron-core's files byte for byte") {
  TempDir dir;
  build_like(expected()["shakespeare"], dir / "s", TokenDType::uint16, false);
  CHECK(read_bytes(dir / "s.bin") == read_bytes(fixture("megatron_shakespeare.bin")));
  CHECK(read_bytes(dir / "s.idx") == read_bytes(fixture("megatron_shakespeare.idx")));
  build_like(expected()["modes"], dir / "m", TokenDType::int32, true);
  CHECK(read_bytes(dir / "m.bin") == read_bytes(fixture("megatron_modes.bin")));
  CHECK(read_bytes(dir / "m.idx") == read_bytes(fixture("megatron_modes.idx")));
  // no temporary files are left behind
  for (const auto& f : fs::directory_iterator(dir.path)) CHECK(f.path().extension() != ".tmp");
}

TEST_CASE("every Megatron dtype round-trips through the builder and the reader") {
  TempDir dir;
  const std::vector<std::vector<std::int64_t>> seqs{{0, 1, 2, 100}, {}, {5}, {127, 3}};
  for (auto dtype : {TokenDType::uint8, TokenDType::int8, TokenDType::int16, TokenDType::int32, TokenDType::int64,
                     TokenDType::float64, TokenDType::float32, TokenDType::uint16}) {
    CAPTURE(dsp::data::token_dtype_name(dtype));
    const auto prefix = dir / std::string(dsp::data::token_dtype_name(dtype));
    {
      IndexedDatasetBuilder b(prefix, dtype);
      b.add_item(seqs[0]);
      b.add_item(seqs[1]);
      b.end_document();
      b.end_document();  // an empty document
      b.add_item(seqs[2]);
      b.add_item(seqs[3]);
      b.end_document();
      CHECK(b.sequence_count() == 4);
      CHECK(b.document_count() == 3);
      b.finalize();
    }
    const IndexedDataset ds(prefix);
    CHECK(ds.dtype() == dtype);
    CHECK(ds.sequence_count() == 4);
    CHECK(ds.document_count() == 3);
    CHECK(ds.document_indices() == std::vector<std::int64_t>{0, 2, 2, 4});
    for (std::int64_t i = 0; i < 4; ++i) {
      const auto& s = seqs[static_cast<std::size_t>(i)];
      CHECK(ds.sequence(i) == std::vector<std::int32_t>(s.begin(), s.end()));
      CHECK(ds.sequence_pointer(i) ==
            (i == 0 ? 0 : ds.sequence_pointer(i - 1) +
                              ds.sequence_length(i - 1) * static_cast<std::int64_t>(dsp::data::token_dtype_size(dtype))));
    }
  }
}

TEST_CASE("add_index appends a whole dataset, as Megatron's builder merges shards") {
  TempDir dir;
  {
    IndexedDatasetBuilder b(dir / "merged", TokenDType::uint16);
    b.add_index(fixture("megatron_shakespeare"));
    b.add_item({7, 8});
    b.end_document();
    b.add_index(fixture("megatron_shakespeare"));
    CHECK_THROWS_AS(b.add_index(fixture("megatron_modes")), dsp::InputError);  // int32, not uint16
    b.finalize();
  }
  const IndexedDataset one(fixture("megatron_shakespeare")), two(dir / "merged");
  const auto s = one.sequence_count(), d = one.document_count();
  REQUIRE(two.sequence_count() == 2 * s + 1);
  REQUIRE(two.document_count() == 2 * d + 1);
  CHECK(two.sequence(s) == std::vector<std::int32_t>{7, 8});
  for (std::int64_t i = 0; i < s; ++i) {
    CHECK(two.sequence(i) == one.sequence(i));
    CHECK(two.sequence(s + 1 + i) == one.sequence(i));
  }
  for (std::int64_t k = 0; k <= d; ++k) CHECK(two.document_index(d + 1 + k) == s + 1 + one.document_index(k));
}

TEST_CASE("tokens that do not fit the dtype are refused; an abandoned builder leaves nothing") {
  TempDir dir;
  {
    IndexedDatasetBuilder b(dir / "u16", TokenDType::uint16);
    CHECK(contains(input_error([&] { b.add_item({1, 70000}); }), "uint16"));
    CHECK_THROWS_AS(b.add_item({-1}), dsp::InputError);
    IndexedDatasetBuilder f(dir / "f32", TokenDType::float32);
    CHECK_THROWS_AS(f.add_item({(std::int64_t{1} << 24) + 1}), dsp::InputError);  // not exact in float
    IndexedDatasetBuilder i8(dir / "i8", TokenDType::int8);
    CHECK_THROWS_AS(i8.add_item(std::vector<double>{1.5}), dsp::InputError);
    CHECK_THROWS_AS(i8.add_item(std::vector<double>{1e300}), dsp::InputError);
  }
  CHECK(fs::is_empty(dir.path));
  IndexedDatasetBuilder b(dir / "twice", TokenDType::int32);
  b.finalize();
  CHECK_THROWS_AS(b.finalize(), dsp::Error);
  CHECK_THROWS_AS(b.add_item({1}), dsp::Error);
  const IndexedDataset empty(dir / "twice");  // an empty dataset: an empty .bin, a 42-byte .idx
  CHECK(empty.sequence_count() == 0);
  CHECK(empty.document_count() == 0);
}

TEST_CASE("missing, truncated and corrupted files are refused naming the file") {
  TempDir dir;
  const auto bin = read_bytes(fixture("megatron_shakespeare.bin"));
  const auto idx = read_bytes(fixture("megatron_shakespeare.idx"));
  const auto open = [](const std::string& prefix) { return input_error([&] { IndexedDataset ds(prefix); }); };

  write_bytes(dir / "no_idx.bin", bin);  // missing .idx
  CHECK(contains(open(dir / "no_idx"), dir / "no_idx.idx"));
  write_bytes(dir / "no_bin.idx", idx);  // missing .bin
  CHECK(contains(open(dir / "no_bin"), dir / "no_bin.bin"));
  CHECK(contains(open(dir / "nothing"), dir / "nothing.idx"));

  write_bytes(dir / "short_bin.idx", idx);  // truncated .bin: the last sequence lies past its end
  write_bytes(dir / "short_bin.bin", bin.substr(0, bin.size() - 1));
  const auto short_bin = open(dir / "short_bin");
  CHECK(contains(short_bin, dir / "short_bin.bin"));
  CHECK(contains(short_bin, "truncated"));

  auto bad = idx;  // bad magic
  bad[0] = 'X';
  write_bytes(dir / "magic.idx", bad);
  write_bytes(dir / "magic.bin", bin);
  const auto magic = open(dir / "magic");
  CHECK(contains(magic, dir / "magic.idx"));
  CHECK(contains(magic, "magic"));

  write_bytes(dir / "short_idx.idx", idx.substr(0, idx.size() - 8));  // truncated .idx
  write_bytes(dir / "short_idx.bin", bin);
  CHECK(contains(open(dir / "short_idx"), dir / "short_idx.idx"));
  write_bytes(dir / "tiny_idx.idx", idx.substr(0, 20));  // shorter than the header
  write_bytes(dir / "tiny_idx.bin", bin);
  CHECK(contains(open(dir / "tiny_idx"), dir / "tiny_idx.idx"));

  bad = idx;  // a sequence count that disagrees with the file size
  bad[18] = static_cast<char>(bad[18] + 1);
  write_bytes(dir / "count.idx", bad);
  write_bytes(dir / "count.bin", bin);
  const auto count = open(dir / "count");
  CHECK(contains(count, dir / "count.idx"));
  CHECK(contains(count, "bytes"));

  bad = idx;  // an unknown dtype code
  bad[17] = 9;
  write_bytes(dir / "dtype.idx", bad);
  write_bytes(dir / "dtype.bin", bin);
  CHECK(contains(open(dir / "dtype"), "dtype code 9"));

  bad = idx;  // version 2
  bad[9] = 2;
  write_bytes(dir / "version.idx", bad);
  write_bytes(dir / "version.bin", bin);
  CHECK(contains(open(dir / "version"), "version 2"));

  bad = idx;  // a document index that does not end at the sequence count
  bad[bad.size() - 8] = static_cast<char>(bad[bad.size() - 8] + 1);
  write_bytes(dir / "docs.idx", bad);
  write_bytes(dir / "docs.bin", bin);
  CHECK(contains(open(dir / "docs"), dir / "docs.idx"));

  fs::create_directories(dir.path / "folder.idx");  // a directory is not a file
  write_bytes(dir / "folder.bin", bin);
  CHECK(contains(open(dir / "folder"), dir / "folder.idx"));
}

}  // namespace data_indexed_dataset_test
