#pragma once
// Tensor: an owning, contiguous, row-major fp32 array with a shape, in host memory or in a
// memory space such as a GPU's (core/memory_space.hpp).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"

namespace dsp {

using Shape = std::vector<std::int64_t>;

/// Number of elements of a shape (1 for a scalar shape {}).
inline std::int64_t numel(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), std::int64_t{1}, std::multiplies<>());
}

/// "[a, b, c]" for error messages.
inline std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// Owning contiguous fp32 tensor, zero-initialised, in host memory or in a MemorySpace (a GPU's
/// memory): the calling thread's current space (core/memory_space.hpp) when it is constructed
/// from a shape. Copyable (deep, into the source's space) and movable. Its storage is counted
/// (live and peak bytes of the allocating thread; host bytes by dsp::memory, a space's in that
/// space's counters) in the category current when it is constructed, or the one given; a copy
/// counts in the current category, a moved tensor keeps its own (core/memory.hpp).
/// Host accessors (span, values, operator[], fill) throw Error for a tensor that is not on the
/// host: copy it with to_host() or copy_to_host() first. data() and raw_span() work anywhere,
/// for ops and communicators of a backend that reads that memory.
class Tensor {
 public:
  using Storage = std::vector<float, memory::CountingAllocator<float>>;

  Tensor() = default;
  explicit Tensor(Shape shape) : Tensor(std::move(shape), memory::current_category()) {}
  /// Zeros counted in `category` whatever scope is current, in the current memory space.
  Tensor(Shape shape, memory::Category category) : Tensor(std::move(shape), category, current_memory_space()) {}
  /// Zeros counted in `category`, in `space` (null: host memory).
  Tensor(Shape shape, memory::Category category, MemorySpace* space) : shape_(std::move(shape)) {
    if (space) {
      block_ = SpaceAllocation(space, bytes_of(dsp::numel(shape_)), category);
    } else {
      data_ = Storage(static_cast<std::size_t>(dsp::numel(shape_)), 0.0f, memory::CountingAllocator<float>(category));
    }
  }
  /// Zeros in host memory whatever memory space is current, counted in the current category:
  /// for host code (checkpoint readers, shard arithmetic) that runs inside a device's scope.
  static Tensor host_zeros(Shape shape) { return Tensor(std::move(shape), memory::current_category(), nullptr); }
  /// Host values. Throws Error when the values do not fill the shape.
  Tensor(Shape shape, const std::vector<float>& values) : Tensor(std::move(shape), Storage(values.begin(), values.end())) {}
  Tensor(Shape shape, std::initializer_list<float> values) : Tensor(std::move(shape), Storage(values)) {}
  Tensor(Shape shape, Storage values) : shape_(std::move(shape)), data_(std::move(values)) {
    DSP_CHECK(static_cast<std::int64_t>(data_.size()) == dsp::numel(shape_), "Tensor: ", data_.size(),
              " values do not fill shape ", shape_str(shape_));
  }
  Tensor(const Tensor& o) : shape_(o.shape_), data_(o.data_) {
    if (!o.block_.space()) return;
    block_ = SpaceAllocation(o.block_.space(), o.block_.bytes(), memory::current_category());
    block_.space()->copy(block_.data(), o.block_.data(), block_.bytes());
  }
  /// Between host tensors the destination keeps its category (core/memory.hpp); otherwise it
  /// becomes a copy as by copy construction.
  Tensor& operator=(const Tensor& o) {
    if (this == &o) return *this;
    if (on_host() && o.on_host()) {
      data_ = o.data_;  // first: if it throws, the shape still matches the elements
      shape_ = o.shape_;
    } else {
      *this = Tensor(o);
    }
    return *this;
  }
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  /// The elements wherever they live (device memory for a device tensor).
  float* data() { return block_.space() ? static_cast<float*>(block_.data()) : data_.data(); }
  const float* data() const { return block_.space() ? static_cast<const float*>(block_.data()) : data_.data(); }
  /// data() as a span: for ops and communicators, never dereferenced here unless on_host().
  std::span<float> raw_span() { return {data(), static_cast<std::size_t>(numel())}; }
  std::span<const float> raw_span() const { return {data(), static_cast<std::size_t>(numel())}; }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t rank() const { return shape_.size(); }
  std::int64_t numel() const {  // of the storage: 0 for a default-constructed or moved-from tensor
    return static_cast<std::int64_t>(block_.space() ? block_.bytes() / sizeof(float) : data_.size());
  }
  bool empty() const { return numel() == 0; }
  /// Whether the elements are in host memory (the host accessors below work).
  bool on_host() const { return !block_.space(); }
  /// The memory space the elements are in; null for host memory.
  MemorySpace* space() const { return block_.space(); }

  /// Host accessors: throw Error for a tensor that is not on the host.
  std::span<float> span() { return host_values(); }
  std::span<const float> span() const { return const_cast<Tensor*>(this)->host_values(); }
  float& operator[](std::int64_t i) { return host_values()[static_cast<std::size_t>(i)]; }
  float operator[](std::int64_t i) const { return const_cast<Tensor*>(this)->host_values()[static_cast<std::size_t>(i)]; }
  Storage& values() {
    host_values();
    return data_;
  }
  const Storage& values() const { return const_cast<Tensor*>(this)->values(); }
  void fill(float v) { std::ranges::fill(host_values(), v); }

  /// Sets every element to zero, wherever they live.
  void zero() {
    if (block_.space()) {
      block_.space()->zero(block_.data(), block_.bytes());
    } else {
      std::ranges::fill(data_, 0.0f);
    }
  }
  /// A copy in `space` (null: host memory), counted in the current category.
  Tensor to(MemorySpace* space) const& {
    if (space == block_.space()) return *this;
    if (numel() == 0 && shape_.empty()) return Tensor{};  // default-constructed or moved-from
    Tensor out(shape_, memory::current_category(), space);
    MemorySpace* copier = space ? space : block_.space();
    copier->copy(out.data(), data(), static_cast<std::size_t>(numel()) * sizeof(float));
    return out;
  }
  /// This tensor in `space`: itself, moved, when it is there already, else a copy.
  Tensor to(MemorySpace* space) && {
    if (space == block_.space()) return std::move(*this);
    return std::as_const(*this).to(space);
  }
  /// A host copy (this tensor itself, copied, when it is on the host already).
  Tensor to_host() const { return to(nullptr); }
  /// Copies every element into host memory `out` / from host memory `in`, wherever the tensor
  /// lives. Throws Error when the span's size is not numel().
  void copy_to_host(std::span<float> out) const {
    check_span(out.size());
    copy_bytes(out.data(), data());
  }
  void copy_from_host(std::span<const float> in) {
    check_span(in.size());
    copy_bytes(data(), in.data());
  }

  /// Same elements, new shape; throws Error when the element counts differ.
  Tensor& reshape(Shape shape) {
    DSP_CHECK(dsp::numel(shape) == numel(), "reshape ", shape_str(shape_), " -> ", shape_str(shape),
              ": element count differs");
    shape_ = std::move(shape);
    return *this;
  }

 private:
  void check_span(std::size_t n) const {
    DSP_CHECK(static_cast<std::int64_t>(n) == numel(), "Tensor ", shape_str(shape_), ": a host span of ", n,
              " elements for ", numel());
  }
  void copy_bytes(void* dst, const void* src) const {
    if (block_.space()) {
      block_.space()->copy(dst, src, block_.bytes());
    } else if (numel() > 0) {
      std::memcpy(dst, src, bytes_of(numel()));
    }
  }
  static std::size_t bytes_of(std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); }
  std::span<float> host_values() {
    DSP_CHECK(on_host(), "Tensor ", shape_str(shape_), " is in ", block_.space()->name(),
              " memory: host code must copy it with to_host() first");
    return data_;
  }

  Shape shape_;
  Storage data_;            // host elements
  SpaceAllocation block_;   // or elements in a memory space
};
// Containers of tensors (std::vector<Tensor> growing) move them rather than copy them, so each
// keeps its storage and that storage's memory category.
static_assert(std::is_nothrow_move_constructible_v<Tensor>);

}  // namespace dsp
