// safetensors: round trip, BF16 reads, and every malformed-file check naming the file.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "dsp/checkpoint/safetensors.hpp"
#include "dsp/core/dtype.hpp"
#include "fixture.hpp"

using namespace checkpoint_test;

namespace checkpoint_safetensors_test {
using dsp::CheckpointError;
using dsp::checkpoint::read_safetensors;
using dsp::checkpoint::write_safetensors;

namespace {

// Writes a safetensors file from a raw header string and data buffer, as another tool would.
void write_raw(const fs::path& path, const std::string& header, const std::string& buffer) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  out << header << buffer;
}

const std::string one_f32 = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

}  // namespace

TEST_CASE("safetensors round trip keeps names, shapes, values and metadata") {
  TempDir tmp;
  const Tensor a({2, 3}, {1, 2, 3, 4, 5, 6.5f}), b({4}, {-1, 0, 1e-30f, 3e38f}), scalar({}, {42});
  const auto path = tmp / "t.safetensors";
  const auto digest = write_safetensors(path, {{"a", &a}, {"b.weight", &b}, {"s", &scalar}}, {{"format", "pt"}});
  CHECK(digest.size == fs::file_size(path));
  CHECK(digest == dsp::checkpoint::digest_file(path));

  const auto f = read_safetensors(path);
  REQUIRE(f.entries().size() == 3);
  CHECK(f.entries()[0].name == "a");  // buffer order = write order
  CHECK(f.entries()[1].name == "b.weight");
  CHECK(f.entry("a").shape == Shape{2, 3});
  CHECK(f.entry("s").shape == Shape{});
  CHECK(f.entry("b.weight").dtype == dsp::DType::F32);
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(same(f.tensor("a"), a));
  CHECK(same(f.tensor("b.weight"), b));
  CHECK(same(f.tensor("s"), scalar));
  // header length is a multiple of 8 so the data buffer is aligned
  std::ifstream in(path, std::ios::binary);
  std::array<unsigned char, 8> bytes{};
  in.read(reinterpret_cast<char*>(bytes.data()), 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
  CHECK(n % 8 == 0);
  CHECK(fs::file_size(path) == 8 + n + 4 * (6 + 4 + 1));

  const auto msg = message_of<CheckpointError>([&] { f.tensor("nope"); });
  CHECK(msg.find(path.string()) != std::string::npos);
  CHECK(msg.find("nope") != std::string::npos);
  CHECK_THROWS_AS(write_safetensors(tmp / "dup.safetensors", {{"a", &a}, {"a", &b}}), CheckpointError);
}

TEST_CASE("safetensors reads BF16 as fp32") {
  TempDir tmp;
  const std::array<float, 3> values = {1.0f, -2.5f, 3.140625f};  // exact in bf16
  std::string buffer;
  for (float v : values) {
    const std::uint16_t bits = dsp::bf16(v).bits;
    buffer += static_cast<char>(bits & 0xff);
    buffer += static_cast<char>(bits >> 8);
  }
  write_raw(tmp / "b.safetensors", R"({"w":{"dtype":"BF16","shape":[3,1],"data_offsets":[0,6]}})", buffer);
  const auto t = read_safetensors(tmp / "b.safetensors").tensor("w");
  CHECK(t.shape() == Shape{3, 1});
  for (int i = 0; i < 3; ++i) CHECK(t[i] == values[static_cast<std::size_t>(i)]);
}

TEST_CASE("safetensors reads F16 and F8_E4M3 as fp32, exactly; an integer tensor is an error naming it") {
  TempDir tmp;
  const std::array<float, 3> values = {1.0f, -2.5f, 0x1p-24f};  // exact in fp16 (the last subnormal)
  std::string buffer;
  for (float v : values) {
    const std::uint16_t bits = dsp::fp16(v).bits;
    buffer += static_cast<char>(bits & 0xff);
    buffer += static_cast<char>(bits >> 8);
  }
  buffer += std::string{'\x38', '\xc4', '\x7e', '\x01'};  // e4m3: 1, -3, 448, 2^-9
  write_raw(tmp / "h.safetensors",
            R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},"q":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[6,10]}})",
            buffer);
  const auto f = read_safetensors(tmp / "h.safetensors");
  const auto h = f.tensor("h");
  for (int i = 0; i < 3; ++i) CHECK(h[i] == values[static_cast<std::size_t>(i)]);
  const auto q = f.tensor("q");
  CHECK(q.shape() == Shape{2, 2});
  CHECK(q[0] == 1.0f);
  CHECK(q[1] == -3.0f);
  CHECK(q[2] == 448.0f);
  CHECK(q[3] == 0x1p-9f);
  std::vector<float> last(2);
  f.read_elements("q", 2, last);  // only those bytes
  CHECK(last == std::vector<float>{448.0f, 0x1p-9f});

  write_raw(tmp / "i.safetensors", R"({"n":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  const auto msg = message_of<CheckpointError>([&] { read_safetensors(tmp / "i.safetensors").tensor("n"); });
  CHECK_MESSAGE(msg.find("i.safetensors: tensor 'n' has dtype I32") != std::string::npos, msg);
}

TEST_CASE("malformed safetensors files throw CheckpointError naming the file") {
  TempDir tmp;
  const auto path = tmp / "bad.safetensors";
  const auto check = [&](const std::string& expected) {
    const auto msg = message_of<CheckpointError>([&] { read_safetensors(path); });
    CHECK_MESSAGE(msg.find(path.string()) != std::string::npos, msg);
    CHECK_MESSAGE(msg.find(expected) != std::string::npos, msg);
  };

  std::ofstream(path, std::ios::binary) << "abcde";
  check("truncated");

  write_raw(path, one_f32, std::string(8, '\0'));
  fs::resize_file(path, 8 + one_f32.size() - 5);  // cut into the header
  check("reaches past the end");

  write_raw(path, one_f32, std::string(8, '\0'));
  fs::resize_file(path, fs::file_size(path) - 3);  // cut into the data
  check("truncated");

  write_raw(path, one_f32, std::string(12, '\0'));  // 4 bytes after the last tensor
  check("data buffer has 12 bytes, the tensors end at byte 8");

  write_raw(path, R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'));
  check("needs 12");

  write_raw(path, R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0'));
  check("starts at byte 4");

  write_raw(path, R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0'));
  check("unknown dtype 'F64'");

  write_raw(path, R"({"x":{"dtype":"F32","shape":[2]}})", std::string(8, '\0'));
  check("malformed header");

  write_raw(path, "not json", "");
  check("not a JSON object");

  CHECK_THROWS_AS(read_safetensors(tmp / "missing.safetensors"), CheckpointError);
}

}  // namespace checkpoint_safetensors_test
