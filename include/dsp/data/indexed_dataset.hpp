#pragma once
// IndexedDataset / IndexedDatasetBuilder: Megatron-LM's indexed dataset, a pair of files
// PREFIX.bin (the tokens of every sequence, back to back, in one dtype) and PREFIX.idx.
//
// The .idx layout, as megatron-core's megatron/core/datasets/indexed_dataset.py (_IndexWriter,
// _IndexReader; checked against megatron-core 0.16.1) writes it, all little-endian:
//   9 bytes   "MMIDIDX\x00\x00"
//   uint64    version, always 1
//   uint8     dtype code (DType: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//             7 float32, 8 uint16)
//   uint64    S, the sequence count
//   uint64    D, the length of the document index (documents + 1)
//   int32[S]  sequence lengths (tokens)
//   int64[S]  sequence pointers (byte offsets into .bin)
//   int64[D]  document indices: document d is sequences [idx[d], idx[d+1]); idx[0] = 0
//   int8[S]   sequence modes, only in multimodal datasets (Megatron is told by a flag; here
//             the file size tells: it must be the size without modes or that plus S)
// The .bin is mapped read-only with POSIX mmap; sequences are views into the mapping.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::data {

/// Megatron's DType codes (megatron/core/datasets/indexed_dataset.py, class DType).
enum class TokenDType : std::uint8_t {
  uint8 = 1, int8 = 2, int16 = 3, int32 = 4, int64 = 5, float64 = 6, float32 = 7, uint16 = 8,
};

/// Bytes per token of a dtype; 0 for a code Megatron does not define.
constexpr std::size_t token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::uint8: case TokenDType::int8: return 1;
    case TokenDType::int16: case TokenDType::uint16: return 2;
    case TokenDType::int32: case TokenDType::float32: return 4;
    case TokenDType::int64: case TokenDType::float64: return 8;
  }
  return 0;
}

/// NumPy's name of a dtype ("uint16"), "unknown" for an undefined code.
constexpr std::string_view token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::uint8: return "uint8";
    case TokenDType::int8: return "int8";
    case TokenDType::int16: return "int16";
    case TokenDType::int32: return "int32";
    case TokenDType::int64: return "int64";
    case TokenDType::float64: return "float64";
    case TokenDType::float32: return "float32";
    case TokenDType::uint16: return "uint16";
  }
  return "unknown";
}

/// Megatron's DType.optimal_dtype: uint16 for a vocabulary under 65500 tokens, else int32.
constexpr TokenDType optimal_token_dtype(std::int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::uint16 : TokenDType::int32;
}

/// The C++ type stored for a dtype: token_type_t<TokenDType::uint16> is std::uint16_t.
template <TokenDType T> struct TokenType;
template <> struct TokenType<TokenDType::uint8> { using type = std::uint8_t; };
template <> struct TokenType<TokenDType::int8> { using type = std::int8_t; };
template <> struct TokenType<TokenDType::int16> { using type = std::int16_t; };
template <> struct TokenType<TokenDType::int32> { using type = std::int32_t; };
template <> struct TokenType<TokenDType::int64> { using type = std::int64_t; };
template <> struct TokenType<TokenDType::float64> { using type = double; };
template <> struct TokenType<TokenDType::float32> { using type = float; };
template <> struct TokenType<TokenDType::uint16> { using type = std::uint16_t; };
template <TokenDType T> using token_type_t = typename TokenType<T>::type;

/// The dtype code of a C++ token type (std::uint16_t -> TokenDType::uint16).
template <class T>
constexpr TokenDType token_dtype_of() {
  if constexpr (std::is_same_v<T, std::uint8_t>) return TokenDType::uint8;
  else if constexpr (std::is_same_v<T, std::int8_t>) return TokenDType::int8;
  else if constexpr (std::is_same_v<T, std::int16_t>) return TokenDType::int16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return TokenDType::int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return TokenDType::int64;
  else if constexpr (std::is_same_v<T, double>) return TokenDType::float64;
  else if constexpr (std::is_same_v<T, float>) return TokenDType::float32;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return TokenDType::uint16;
  else static_assert(sizeof(T) == 0, "not a Megatron token dtype");
}

/// PREFIX.idx and PREFIX.bin, as Megatron's get_idx_path / get_bin_path name them.
inline std::string indexed_idx_path(const std::string& prefix) { return prefix + ".idx"; }
inline std::string indexed_bin_path(const std::string& prefix) { return prefix + ".bin"; }

namespace detail {

/// The 9-byte magic at the start of every .idx.
inline constexpr char kIndexHeader[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
/// Bytes before the sequence lengths: magic 9 + version 8 + dtype 1 + S 8 + D 8.
inline constexpr std::uint64_t kIndexPreamble = 34;

/// A whole file mapped read-only (POSIX mmap); an empty file maps to an empty span.
class MappedFile {
 public:
  MappedFile() = default;
  /// Maps `path`. Throws InputError naming the file when it is missing, a directory or unreadable.
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    DSP_CHECK_AS(InputError, fd >= 0, "indexed dataset file '", path, "' cannot be opened: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw InputError(::dsp::detail::concat("indexed dataset file '", path, "' is not a regular file"));
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      const int err = errno;
      ::close(fd);
      DSP_CHECK_AS(InputError, p != MAP_FAILED, "indexed dataset file '", path, "' cannot be mapped: ", std::strerror(err));
      data_ = static_cast<const unsigned char*>(p);
    } else {
      ::close(fd);
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept { swap(o); }
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      swap(o);
    }
    return *this;
  }
  ~MappedFile() { unmap(); }

  const unsigned char* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void swap(MappedFile& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(path_, o.path_);
  }
  void unmap() noexcept {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
  }
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
  std::string path_;
};

template <class T>
T read_le(const unsigned char* p) {  // the format is little-endian, as is every host dsp runs on
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace detail

/// A Megatron indexed dataset opened read-only. Construction checks the whole index against
/// both file sizes, so that every later access is in bounds. Movable, not copyable; typed
/// sequence spans stay valid while the dataset lives.
class IndexedDataset {
 public:
  /// Opens PREFIX.idx and PREFIX.bin. Throws InputError naming the file when either is missing
  /// or not a regular file, the .idx is shorter than its 34-byte preamble, has a bad magic,
  /// a version other than 1 or an unknown dtype code, when its size disagrees with its counts
  /// (34 + 20 S + 8 D bytes, or S more with modes), when the document index does not run
  /// 0 ... S without going back, a sequence length is negative, or a sequence lies past the end
  /// of the .bin (a truncated .bin).
  explicit IndexedDataset(const std::string& prefix)
      : prefix_(prefix), idx_(indexed_idx_path(prefix)), bin_(indexed_bin_path(prefix)) {
    const auto& ip = idx_.path();
    const unsigned char* p = idx_.data();
    const std::uint64_t size = idx_.size();
    DSP_CHECK_AS(InputError, size >= detail::kIndexPreamble, "indexed dataset index '", ip, "' is truncated: ", size,
                 " bytes, shorter than the 34-byte header");
    DSP_CHECK_AS(InputError, std::memcmp(p, detail::kIndexHeader, 9) == 0, "indexed dataset index '", ip,
                 "' has a bad magic: not a Megatron MMIDIDX index");
    const auto version = detail::read_le<std::uint64_t>(p + 9);
    DSP_CHECK_AS(InputError, version == 1, "indexed dataset index '", ip, "' has version ", version, ", not 1");
    dtype_ = static_cast<TokenDType>(p[17]);
    item_size_ = token_dtype_size(dtype_);
    DSP_CHECK_AS(InputError, item_size_ != 0, "indexed dataset index '", ip, "' has unknown dtype code ",
                 static_cast<int>(p[17]));
    const auto s = detail::read_le<std::uint64_t>(p + 18);
    const auto d = detail::read_le<std::uint64_t>(p + 26);
    // Both counts are bounded by the file size before any product is formed (no overflow).
    const std::uint64_t body = size - detail::kIndexPreamble;
    DSP_CHECK_AS(InputError, s <= body / 12 && d <= body / 8, "indexed dataset index '", ip, "' claims ", s,
                 " sequences and ", d, " document indices: more than its ", size, " bytes hold (truncated?)");
    const std::uint64_t plain = detail::kIndexPreamble + 12 * s + 8 * d;
    DSP_CHECK_AS(InputError, size == plain || size == plain + s, "indexed dataset index '", ip, "' has ", size,
                 " bytes but its counts (", s, " sequences, ", d, " document indices) need ", plain, " (or ",
                 plain + s, " with sequence modes): truncated or not an index");
    has_modes_ = size == plain + s && s > 0;
    sequence_count_ = static_cast<std::int64_t>(s);
    lengths_ = p + detail::kIndexPreamble;
    pointers_ = p + detail::kIndexPreamble + 4 * s;
    doc_idx_ = p + detail::kIndexPreamble + 12 * s;
    modes_ = reinterpret_cast<const std::int8_t*>(p + plain);
    doc_idx_count_ = static_cast<std::int64_t>(d);

    DSP_CHECK_AS(InputError, d >= 1 && document_index(0) == 0 && document_index(doc_idx_count_ - 1) == sequence_count_, "indexed dataset index '",
                 ip, "' has a document index that does not run from 0 to the ", s, " sequences");
    for (std::uint64_t k = 1; k < d; ++k)
      DSP_CHECK_AS(InputError, document_index(static_cast<std::int64_t>(k)) >= document_index(static_cast<std::int64_t>(k - 1)), "indexed dataset index '", ip,
                   "' has a decreasing document index at document ", k - 1);
    const auto bin_size = static_cast<std::int64_t>(bin_.size());
    const auto item = static_cast<std::int64_t>(item_size_);
    for (std::int64_t i = 0; i < sequence_count_; ++i) {
      const std::int64_t len = sequence_length(i), ptr = sequence_pointer(i);
      DSP_CHECK_AS(InputError, len >= 0 && ptr >= 0 && ptr % item == 0, "indexed dataset index '", ip,
                   "' has a bad sequence ", i, " (length ", len, ", pointer ", ptr, ")");
      DSP_CHECK_AS(InputError, ptr <= bin_size && len <= (bin_size - ptr) / item, "indexed dataset data '",
                   bin_.path(), "' is truncated: ", bin_size, " bytes, but sequence ", i, " of '", ip, "' ends at byte ",
                   ptr + len * item);
    }
  }

  /// The prefix this was opened from (without .idx/.bin).
  const std::string& prefix() const { return prefix_; }
  /// The token dtype of the .bin.
  TokenDType dtype() const { return dtype_; }
  /// Number of sequences S.
  std::int64_t sequence_count() const { return sequence_count_; }
  /// Number of documents: D - 1, one less than the count stored in the header.
  std::int64_t document_count() const { return doc_idx_count_ - 1; }
  /// Tokens in sequence i (no range check: i in [0, S)).
  std::int32_t sequence_length(std::int64_t i) const { return detail::read_le<std::int32_t>(lengths_ + 4 * i); }
  /// Byte offset of sequence i in the .bin (no range check: i in [0, S)).
  std::int64_t sequence_pointer(std::int64_t i) const { return detail::read_le<std::int64_t>(pointers_ + 8 * i); }
  /// Entry k of Megatron's document index (no range check: k in [0, documents]); document d is
  /// sequences [document_index(d), document_index(d + 1)).
  std::int64_t document_index(std::int64_t k) const { return detail::read_le<std::int64_t>(doc_idx_ + 8 * k); }
  /// A copy of every sequence length, [S] (Megatron's IndexedDataset.sequence_lengths).
  std::vector<std::int32_t> sequence_lengths() const {
    std::vector<std::int32_t> v(static_cast<std::size_t>(sequence_count_));
    if (!v.empty()) std::memcpy(v.data(), lengths_, v.size() * 4);
    return v;
  }
  /// A copy of the document index, [documents + 1] (Megatron's IndexedDataset.document_indices).
  std::vector<std::int64_t> document_indices() const {
    std::vector<std::int64_t> v(static_cast<std::size_t>(doc_idx_count_));
    std::memcpy(v.data(), doc_idx_, v.size() * 8);
    return v;
  }
  /// Whether the index carries a mode byte per sequence (a multimodal dataset).
  bool has_sequence_modes() const { return has_modes_; }
  /// The mode of every sequence, [S]; empty without modes.
  std::span<const std::int8_t> sequence_modes() const {
    return {modes_, has_modes_ ? static_cast<std::size_t>(sequence_count_) : 0};
  }
  /// Sequences [first, last) of document d. Throws InputError when d is out of range.
  std::pair<std::int64_t, std::int64_t> document(std::int64_t d) const {
    DSP_CHECK_AS(InputError, d >= 0 && d < document_count(), "document ", d, " out of range: '", prefix_, "' has ",
                 document_count(), " documents");
    return {document_index(d), document_index(d + 1)};
  }

  /// Sequence i as stored, a view into the mapping. Throws InputError when T is not the file's
  /// dtype or i is out of range.
  template <class T>
  std::span<const T> typed_sequence(std::int64_t i) const {
    check_sequence(i);
    DSP_CHECK_AS(InputError, token_dtype_of<T>() == dtype_, "indexed dataset '", prefix_, "' holds ",
                 token_dtype_name(dtype_), " tokens, read as ", token_dtype_name(token_dtype_of<T>()));
    // .bin offsets are multiples of the token size (checked at open) from a page-aligned mapping.
    return {reinterpret_cast<const T*>(bin_.data() + sequence_pointer(i)), static_cast<std::size_t>(sequence_length(i))};
  }

  /// The bytes of sequence i in the .bin (sequence_length(i) * token size of them; no range check).
  const unsigned char* sequence_bytes(std::int64_t i) const { return bin_.data() + sequence_pointer(i); }

  /// Appends tokens [offset, offset + length) of sequence i to `out`, converted to int32 (a
  /// length of -1: to the end), as Megatron's IndexedDataset.get(i, offset, length). Throws
  /// InputError when i or the range is out of bounds, or a token does not fit int32 (int64 and
  /// float files; a float token must be integral).
  void read(std::int64_t i, std::vector<std::int32_t>& out, std::int64_t offset = 0, std::int64_t length = -1) const {
    check_sequence(i);
    const std::int64_t n = sequence_length(i);
    if (length < 0) length = n - offset;
    DSP_CHECK_AS(InputError, offset >= 0 && length >= 0 && offset + length <= n, "tokens [", offset, ", ",
                 offset + length, ") out of range: sequence ", i, " of '", prefix_, "' has ", n);
    const unsigned char* base = bin_.data() + sequence_pointer(i) + offset * static_cast<std::int64_t>(item_size_);
    const auto old = out.size();
    out.resize(old + static_cast<std::size_t>(length));
    std::int32_t* dst = out.data() + old;
    switch (dtype_) {
      case TokenDType::uint8: convert<std::uint8_t>(base, length, dst, i); break;
      case TokenDType::int8: convert<std::int8_t>(base, length, dst, i); break;
      case TokenDType::int16: convert<std::int16_t>(base, length, dst, i); break;
      case TokenDType::int32: convert<std::int32_t>(base, length, dst, i); break;
      case TokenDType::int64: convert<std::int64_t>(base, length, dst, i); break;
      case TokenDType::float64: convert<double>(base, length, dst, i); break;
      case TokenDType::float32: convert<float>(base, length, dst, i); break;
      case TokenDType::uint16: convert<std::uint16_t>(base, length, dst, i); break;
    }
  }

  /// Sequence i as int32 tokens (see read for what is thrown).
  std::vector<std::int32_t> sequence(std::int64_t i) const {
    std::vector<std::int32_t> out;
    read(i, out);
    return out;
  }

 private:
  void check_sequence(std::int64_t i) const {
    DSP_CHECK_AS(InputError, i >= 0 && i < sequence_count_, "sequence ", i, " out of range: '", prefix_, "' has ",
                 sequence_count_, " sequences");
  }
  template <class T>
  void convert(const unsigned char* src, std::int64_t n, std::int32_t* dst, std::int64_t seq) const {
    for (std::int64_t k = 0; k < n; ++k) {
      const T v = detail::read_le<T>(src + k * static_cast<std::int64_t>(sizeof(T)));
      if constexpr (sizeof(T) < 4 || std::is_same_v<T, std::int32_t>) {
        dst[k] = static_cast<std::int32_t>(v);
      } else {
        const bool fits = std::is_floating_point_v<T>
                              ? (v >= -2147483648.0 && v <= 2147483647.0 && std::trunc(v) == v)
                              : (v >= std::numeric_limits<std::int32_t>::min() &&
                                 v <= std::numeric_limits<std::int32_t>::max());
        DSP_CHECK_AS(InputError, fits, "token ", k, " of sequence ", seq, " of '", bin_.path(), "' (", v,
                     ") is not an int32 token id");
        dst[k] = static_cast<std::int32_t>(v);
      }
    }
  }

  std::string prefix_;
  detail::MappedFile idx_, bin_;
  TokenDType dtype_ = TokenDType::int32;
  std::size_t item_size_ = 4;
  std::int64_t sequence_count_ = 0, doc_idx_count_ = 1;
  // The index arrays start at byte 34 of the mapping, so they are not aligned for their types:
  // they are read with memcpy (detail::read_le), never through a cast pointer.
  const unsigned char* lengths_ = nullptr;
  const unsigned char* pointers_ = nullptr;
  const unsigned char* doc_idx_ = nullptr;
  const std::int8_t* modes_ = nullptr;
  bool has_modes_ = false;
};

/// Writes a Megatron indexed dataset, as megatron-core's IndexedDatasetBuilder does: items
/// (sequences) are appended to the data file as they come, end_document() closes a document,
/// finalize() writes the index. The files are written as PREFIX.bin.tmp / PREFIX.idx.tmp,
/// flushed to disk, then renamed over PREFIX.bin and PREFIX.idx (each rename is atomic; a crash
/// between the two leaves a new .bin beside an old .idx, which IndexedDataset refuses unless
/// the sizes happen to agree). A builder destroyed before finalize() removes its .tmp files.
class IndexedDatasetBuilder {
 public:
  /// Starts PREFIX.bin.tmp. `multimodal` writes a mode byte per sequence. Throws InputError
  /// naming the file when it cannot be created.
  explicit IndexedDatasetBuilder(std::string prefix, TokenDType dtype = TokenDType::int32, bool multimodal = false)
      : prefix_(std::move(prefix)), dtype_(dtype), multimodal_(multimodal) {
    DSP_CHECK_AS(InputError, token_dtype_size(dtype) != 0, "unknown token dtype code ", static_cast<int>(dtype));
    bin_ = std::fopen(tmp_bin().c_str(), "wb");
    DSP_CHECK_AS(InputError, bin_ != nullptr, "indexed dataset file '", tmp_bin(), "' cannot be created: ",
                 std::strerror(errno));
  }
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;
  ~IndexedDatasetBuilder() {
    if (bin_ != nullptr) {
      std::fclose(bin_);
      std::remove(tmp_bin().c_str());
    }
  }

  /// Appends one sequence (any range of integer or floating tokens) with its mode (kept only
  /// when multimodal). Throws InputError when a token does not fit the dtype exactly (e.g. 70000
  /// or -1 into uint16) or the sequence has 2^31 tokens or more; dsp::Error after finalize().
  template <class Range>
  void add_item(const Range& tokens, std::int8_t mode = 0) {
    DSP_CHECK(bin_ != nullptr, "IndexedDatasetBuilder '", prefix_, "': add_item after finalize");
    std::int64_t n = 0;
    switch (dtype_) {
      case TokenDType::uint8: n = write<std::uint8_t>(tokens); break;
      case TokenDType::int8: n = write<std::int8_t>(tokens); break;
      case TokenDType::int16: n = write<std::int16_t>(tokens); break;
      case TokenDType::int32: n = write<std::int32_t>(tokens); break;
      case TokenDType::int64: n = write<std::int64_t>(tokens); break;
      case TokenDType::float64: n = write<double>(tokens); break;
      case TokenDType::float32: n = write<float>(tokens); break;
      case TokenDType::uint16: n = write<std::uint16_t>(tokens); break;
    }
    lengths_.push_back(static_cast<std::int32_t>(n));
    if (multimodal_) modes_.push_back(mode);
  }
  /// Appends a brace list of tokens: add_item({1, 2, 3}).
  void add_item(std::initializer_list<std::int64_t> tokens, std::int8_t mode = 0) {
    add_item(std::span<const std::int64_t>(tokens.begin(), tokens.size()), mode);
  }

  /// Ends the current document: the sequences added since the previous end_document() (an
  /// empty document when none were).
  void end_document() { doc_idx_.push_back(static_cast<std::int64_t>(lengths_.size())); }

  /// Appends a whole indexed dataset (Megatron's add_index): its sequences, documents and
  /// tokens. Throws InputError (from IndexedDataset) for a bad dataset, or when its dtype or
  /// modality differs from this builder's.
  void add_index(const std::string& other_prefix) {
    DSP_CHECK(bin_ != nullptr, "IndexedDatasetBuilder '", prefix_, "': add_index after finalize");
    IndexedDataset other(other_prefix);
    DSP_CHECK_AS(InputError, other.dtype() == dtype_, "indexed dataset '", other_prefix, "' holds ",
                 token_dtype_name(other.dtype()), " tokens, the builder of '", prefix_, "' ", token_dtype_name(dtype_));
    DSP_CHECK_AS(InputError, other.has_sequence_modes() == multimodal_ || other.sequence_count() == 0,
                 "indexed dataset '", other_prefix, "' is ", other.has_sequence_modes() ? "" : "not ",
                 "multimodal, unlike the builder of '", prefix_, "'");
    const auto offset = static_cast<std::int64_t>(lengths_.size());
    for (std::int64_t i = 0; i < other.sequence_count(); ++i) {
      lengths_.push_back(other.sequence_length(i));
      if (multimodal_) modes_.push_back(other.sequence_modes()[static_cast<std::size_t>(i)]);
      const auto bytes = static_cast<std::size_t>(other.sequence_length(i)) * token_dtype_size(dtype_);
      if (bytes > 0) put(other.sequence_bytes(i), bytes);
    }
    for (std::int64_t k = 1; k <= other.document_count(); ++k) doc_idx_.push_back(offset + other.document_index(k));
  }

  /// Sequences added so far.
  std::int64_t sequence_count() const { return static_cast<std::int64_t>(lengths_.size()); }
  /// Documents ended so far.
  std::int64_t document_count() const { return static_cast<std::int64_t>(doc_idx_.size()) - 1; }

  /// Writes PREFIX.idx and moves both files in place (see the class comment). Sequences added
  /// after the last end_document() belong to no document, as in Megatron (end the document
  /// first). Throws InputError naming the file when a write, flush or rename fails; dsp::Error
  /// when called twice.
  void finalize() {
    DSP_CHECK(bin_ != nullptr, "IndexedDatasetBuilder '", prefix_, "': finalize called twice");
    flush_and_close(bin_, tmp_bin());
    bin_ = nullptr;
    const std::string tmp_idx = indexed_idx_path(prefix_) + ".tmp";
    std::FILE* idx = std::fopen(tmp_idx.c_str(), "wb");
    DSP_CHECK_AS(InputError, idx != nullptr, "indexed dataset file '", tmp_idx, "' cannot be created: ", std::strerror(errno));
    const auto s = static_cast<std::uint64_t>(lengths_.size()), d = static_cast<std::uint64_t>(doc_idx_.size());
    const std::uint64_t version = 1;
    const auto code = static_cast<std::uint8_t>(dtype_);
    bool ok = std::fwrite(detail::kIndexHeader, 1, 9, idx) == 9 && std::fwrite(&version, 8, 1, idx) == 1 &&
              std::fwrite(&code, 1, 1, idx) == 1 && std::fwrite(&s, 8, 1, idx) == 1 && std::fwrite(&d, 8, 1, idx) == 1;
    std::vector<std::int64_t> pointers(lengths_.size());
    const auto item = static_cast<std::int64_t>(token_dtype_size(dtype_));
    std::int64_t ptr = 0;  // Megatron's _sequence_pointers: running sum of length * itemsize
    for (std::size_t i = 0; i < lengths_.size(); ++i) {
      pointers[i] = ptr;
      ptr += std::int64_t{lengths_[i]} * item;
    }
    const auto put_all = [idx](const void* data, std::size_t item_bytes, std::uint64_t n) {
      return n == 0 || std::fwrite(data, item_bytes, n, idx) == n;  // fwrite(nullptr, ...) is undefined
    };
    ok = ok && put_all(lengths_.data(), 4, s) && put_all(pointers.data(), 8, s) && put_all(doc_idx_.data(), 8, d) &&
         (!multimodal_ || put_all(modes_.data(), 1, s));
    if (!ok) {
      std::fclose(idx);
      std::remove(tmp_idx.c_str());
      throw InputError(::dsp::detail::concat("indexed dataset file '", tmp_idx, "' cannot be written"));
    }
    flush_and_close(idx, tmp_idx);
    rename_over(tmp_bin(), indexed_bin_path(prefix_));
    rename_over(tmp_idx, indexed_idx_path(prefix_));
  }

 private:
  std::string tmp_bin() const { return indexed_bin_path(prefix_) + ".tmp"; }

  template <class T, class Range>
  std::int64_t write(const Range& tokens) {
    std::vector<T> buf;
    for (const auto& t : tokens) {
      const auto k = static_cast<std::int64_t>(buf.size());
      using From = std::decay_t<decltype(t)>;
      bool exact;
      if constexpr (std::is_integral_v<From> && std::is_integral_v<T>)
        exact = std::in_range<T>(t);
      else if constexpr (std::is_floating_point_v<From> && std::is_integral_v<T>)  // range first: no UB cast
        exact = static_cast<double>(t) >= static_cast<double>(std::numeric_limits<T>::min()) &&
                static_cast<double>(t) < std::ldexp(1.0, std::numeric_limits<T>::digits) &&  // max + 1
                std::trunc(static_cast<double>(t)) == static_cast<double>(t);
      else
        exact = static_cast<double>(static_cast<T>(t)) == static_cast<double>(t);
      DSP_CHECK_AS(InputError, exact, "token ", k, " (", t, ") of sequence ", lengths_.size(), " does not fit the ",
                   token_dtype_name(dtype_), " tokens of '", prefix_, "'");
      buf.push_back(static_cast<T>(t));
    }
    DSP_CHECK_AS(InputError, buf.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 "sequence ", lengths_.size(), " of '", prefix_, "' has ", buf.size(), " tokens: over int32");
    if (!buf.empty()) put(buf.data(), buf.size() * sizeof(T));
    return static_cast<std::int64_t>(buf.size());
  }
  void put(const void* data, std::size_t bytes) {
    DSP_CHECK_AS(InputError, std::fwrite(data, 1, bytes, bin_) == bytes, "indexed dataset file '", tmp_bin(),
                 "' cannot be written: ", std::strerror(errno));
  }
  static void flush_and_close(std::FILE* f, const std::string& path) {
    const bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    const bool closed = std::fclose(f) == 0;
    DSP_CHECK_AS(InputError, ok && closed, "indexed dataset file '", path, "' cannot be flushed: ", std::strerror(errno));
  }
  static void rename_over(const std::string& from, const std::string& to) {
    DSP_CHECK_AS(InputError, std::rename(from.c_str(), to.c_str()) == 0, "indexed dataset file '", from,
                 "' cannot be renamed to '", to, "': ", std::strerror(errno));
  }

  std::string prefix_;
  TokenDType dtype_;
  bool multimodal_;
  std::FILE* bin_ = nullptr;
  std::vector<std::int32_t> lengths_;
  std::vector<std::int64_t> doc_idx_{0};
  std::vector<std::int8_t> modes_;
};

}  // namespace dsp::data
