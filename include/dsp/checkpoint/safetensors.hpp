#pragma once
// The safetensors format (https://github.com/huggingface/safetensors):
//
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8 + N)    JSON header: {"<tensor name>": {"dtype": "F32", "shape": [d0, d1, ...],
//                                      "data_offsets": [begin, end]}, ...,
//                                     "__metadata__": {"<key>": "<string value>", ...}}
//                       (padded with spaces so the data buffer starts 8-byte aligned)
//   bytes [8 + N, end)  the data buffer: row-major little-endian elements; data_offsets are
//                       byte offsets relative to the buffer's start, tensors packed back to
//                       back without holes, the last one ending at the end of the file.
//
// dsp writes fp32 ("F32"); it reads F32, BF16, F16 and F8_E4M3 (converted to fp32 exactly; an
// F8_E4M3 tensor's block scale is applied by the importer, hf_import.hpp).
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsp/checkpoint/file_io.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/tensor.hpp"

namespace dsp::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and dsp reads and writes host memory directly");

/// One tensor described by a safetensors header.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  std::uint64_t begin = 0;  ///< first byte, relative to the start of the data buffer
  std::uint64_t end = 0;    ///< one past the last byte, relative to the start of the data buffer
};

/// The validated header of a safetensors file; tensor data is read on demand.
class SafetensorsFile {
 public:
  const std::filesystem::path& path() const { return path_; }
  /// The "__metadata__" map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Every tensor, in data buffer order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }

  /// Whether the file holds a tensor called `name`.
  bool contains(std::string_view name) const {
    return std::any_of(entries_.begin(), entries_.end(), [&](const auto& e) { return e.name == name; });
  }
  /// The entry called `name`. Throws CheckpointError naming the file and the tensor when absent.
  const SafetensorsEntry& entry(std::string_view name) const {
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e.name == name; });
    if (it == entries_.end())
      throw CheckpointError(dsp::detail::concat(path_.string(), ": no tensor named '", name, "'"));
    return *it;
  }

  /// Reads tensor `name` as fp32 (BF16, F16 and F8_E4M3 widened exactly). Throws CheckpointError
  /// naming the file when the tensor is absent, has an integer dtype, or cannot be read.
  Tensor tensor(std::string_view name) const {
    Tensor t = Tensor::host_zeros(entry(name).shape);
    read_elements(name, 0, t.span());
    return t;
  }

  /// Reads elements [first, first + out.size()) of tensor `name`, flattened row-major, as fp32
  /// (BF16, F16 and F8_E4M3 widened exactly: reads only those elements' bytes). Throws
  /// CheckpointError naming the file when the tensor is absent, has an integer dtype, the
  /// elements lie outside it, or they cannot be read.
  void read_elements(std::string_view name, std::int64_t first, std::span<float> out) const {
    const SafetensorsEntry& e = entry(name);
    const auto count = static_cast<std::int64_t>(out.size());
    DSP_CHECK_AS(CheckpointError, first >= 0 && first + count <= numel(e.shape), path_.string(), ": tensor '", name,
                 "' of shape ", shape_str(e.shape), " has no elements [", first, ", ", first + count, ")");
    switch (e.dtype) {
      case DType::F32:
        read_at(path_, data_start_ + e.begin + static_cast<std::uint64_t>(first) * 4, std::as_writable_bytes(out));
        break;
      case DType::BF16: widen<std::uint16_t>(e, first, out, bf16::to_float); break;
      case DType::F16: widen<std::uint16_t>(e, first, out, fp16::to_float); break;
      case DType::F8_E4M3: widen<std::uint8_t>(e, first, out, fp8_e4m3::to_float); break;
      default:
        throw CheckpointError(dsp::detail::concat(path_.string(), ": tensor '", name, "' has dtype ",
                                                  dtype_name(e.dtype), "; only F32, BF16, F16 and F8_E4M3 are read"));
    }
  }

 private:
  friend SafetensorsFile read_safetensors(const std::filesystem::path& path);

  // Reads out.size() elements of type Bits from element `first` of e and converts each.
  template <class Bits, class Convert>
  void widen(const SafetensorsEntry& e, std::int64_t first, std::span<float> out, Convert convert) const {
    std::vector<Bits> bits(out.size());
    read_at(path_, data_start_ + e.begin + static_cast<std::uint64_t>(first) * sizeof(Bits),
            std::as_writable_bytes(std::span(bits)));
    std::transform(bits.begin(), bits.end(), out.begin(), convert);
  }

  std::filesystem::path path_;
  std::uint64_t data_start_ = 0;  // 8 + N: file offset of the data buffer
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
};

/// One tensor to write: its name, shape and fp32 elements (numel(shape) of them, row-major).
struct TensorRef {
  std::string name;
  Shape shape;
  std::span<const float> data;
};

/// Writes `tensors` (stored in this order as "F32") and `metadata` as a safetensors file at
/// `path` (created or overwritten; not fsynced: see AtomicDir). Returns the file's size and
/// CRC-32. Throws CheckpointError naming the file when a tensor's data does not match its
/// shape, a name repeats or is "__metadata__", or the file cannot be written.
inline FileDigest write_safetensors(const std::filesystem::path& path, const std::vector<TensorRef>& tensors,
                                    const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const TensorRef& t : tensors) {
    DSP_CHECK_AS(CheckpointError, static_cast<std::int64_t>(t.data.size()) == numel(t.shape), path.string(),
                 ": tensor '", t.name, "' has ", t.data.size(), " elements for shape ", shape_str(t.shape));
    DSP_CHECK_AS(CheckpointError, t.name != "__metadata__" && !header.contains(t.name), path.string(),
                 ": tensor name '", t.name, "' is repeated or reserved");
    const std::uint64_t bytes = t.data.size() * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::array<std::byte, 8> length{};
  for (std::size_t i = 0; i < 8; ++i) length[i] = static_cast<std::byte>(text.size() >> (8 * i));

  FileWriter out(path);
  out.write(length);
  out.write(std::as_bytes(std::span(text)));
  for (const TensorRef& t : tensors) out.write(std::as_bytes(t.data));
  return out.close();
}

/// write_safetensors of whole tensors (name -> fp32 tensor). Tensors in a memory space (device
/// memory) are copied to the host first, all of the file's at once (Tensor::to_host). Throws
/// CheckpointError naming the file when a tensor pointer is null, otherwise as above.
inline FileDigest write_safetensors(const std::filesystem::path& path,
                                    const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                                    const std::map<std::string, std::string>& metadata = {}) {
  std::vector<TensorRef> refs;
  std::deque<Tensor> host_copies;  // stable addresses while refs point into them
  for (const auto& [name, t] : tensors) {
    DSP_CHECK_AS(CheckpointError, t != nullptr, path.string(), ": tensor '", name, "' has no data");
    const Tensor& host = t->on_host() ? *t : host_copies.emplace_back(t->to_host());
    refs.push_back({name, host.shape(), host.span()});
  }
  return write_safetensors(path, refs, metadata);
}

/// Reads and validates the header of the safetensors file at `path`. Throws CheckpointError
/// naming the file when: it is shorter than 8 bytes ("truncated"), the header length reaches
/// past the end of the file, the header is not valid JSON of the form above, a dtype is unknown,
/// a tensor's data_offsets lie outside the data buffer ("truncated" when they pass its end) or
/// do not span shape x dtype size bytes, tensors are not packed back to back, or the data
/// buffer's size differs from where the last tensor ends.
inline SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  const auto fail = [&](const auto&... what) {
    return CheckpointError(dsp::detail::concat(path.string(), ": ", what...));
  };
  const std::uint64_t size = size_of_file(path);
  if (size < 8) throw fail("truncated: ", size, " bytes, shorter than the 8-byte header length");
  std::array<std::byte, 8> length_bytes{};
  read_at(path, 0, length_bytes);
  std::uint64_t length = 0;
  for (std::size_t i = 0; i < 8; ++i) length |= std::to_integer<std::uint64_t>(length_bytes[i]) << (8 * i);
  if (length > size - 8)
    throw fail("header length ", length, " reaches past the end of the file (", size, " bytes)");

  std::string text(length, '\0');
  read_at(path, 8, std::as_writable_bytes(std::span(text)));
  const nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) throw fail("header is not a JSON object");

  SafetensorsFile file;
  file.path_ = path;
  file.data_start_ = 8 + length;
  const std::uint64_t buffer = size - file.data_start_;
  try {
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        file.metadata_ = value.get<std::map<std::string, std::string>>();
        continue;
      }
      SafetensorsEntry e{name, DType::F32, value.at("shape").get<Shape>(), 0, 0};
      const std::string dtype = value.at("dtype").get<std::string>();
      try {
        e.dtype = dtype_from_name(dtype);
      } catch (const Error&) {
        throw fail("tensor '", name, "' has unknown dtype '", dtype, "'");
      }
      const auto offsets = value.at("data_offsets").get<std::array<std::uint64_t, 2>>();
      e.begin = offsets[0];
      e.end = offsets[1];
      if (std::any_of(e.shape.begin(), e.shape.end(), [](std::int64_t d) { return d < 0; }))
        throw fail("tensor '", name, "' has negative shape ", shape_str(e.shape));
      if (e.begin > e.end) throw fail("tensor '", name, "' has data_offsets [", e.begin, ", ", e.end, "]");
      if (e.end > buffer)
        throw fail("truncated: tensor '", name, "' ends at byte ", e.end, " of a data buffer of ", buffer,
                   " bytes");
      const std::uint64_t expected = static_cast<std::uint64_t>(numel(e.shape)) * dtype_size(e.dtype);
      if (e.end - e.begin != expected)
        throw fail("tensor '", name, "' has ", e.end - e.begin, " bytes, its shape ", shape_str(e.shape), " x ",
                   dtype_name(e.dtype), " needs ", expected);
      file.entries_.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    throw fail("malformed header: ", e.what());
  }
  std::stable_sort(file.entries_.begin(), file.entries_.end(),
                   [](const auto& a, const auto& b) { return a.begin < b.begin; });
  std::uint64_t packed_end = 0;
  for (const auto& e : file.entries_) {
    if (e.begin != packed_end)
      throw fail("tensor '", e.name, "' starts at byte ", e.begin, " of the data buffer, expected ", packed_end);
    packed_end = e.end;
  }
  if (packed_end != buffer) throw fail("data buffer has ", buffer, " bytes, the tensors end at byte ", packed_end);
  return file;
}

}  // namespace dsp::checkpoint
