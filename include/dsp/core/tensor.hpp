#pragma once
// Tensor: an owning, contiguous, row-major fp32 array with a shape; TensorView: a
// non-owning window (pointer + shape) onto the same kind of memory. Host memory only; the
// CUDA backend (a later issue) brings its own storage.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"

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

/// Non-owning view of contiguous fp32 memory with a shape. Cheap to copy.
class TensorView {
 public:
  TensorView() = default;
  TensorView(float* data, Shape shape) : data_(data), shape_(std::move(shape)) {}

  float* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t rank() const { return shape_.size(); }
  std::int64_t numel() const { return dsp::numel(shape_); }
  std::span<float> span() const { return {data_, static_cast<std::size_t>(numel())}; }
  float& operator[](std::int64_t i) const { return data_[i]; }

 private:
  float* data_ = nullptr;
  Shape shape_;
};

/// Owning contiguous fp32 tensor, zero-initialised. Copyable (deep) and movable. Its storage is
/// counted by dsp::memory (live and peak bytes of the allocating thread) in the category current
/// when it is constructed, or the one given; a copy counts in the current category, a moved
/// tensor keeps its own (core/memory.hpp).
class Tensor {
 public:
  using Storage = std::vector<float, memory::CountingAllocator<float>>;

  Tensor() = default;
  explicit Tensor(Shape shape) : Tensor(std::move(shape), memory::current_category()) {}
  /// Zeros counted in `category` whatever scope is current.
  Tensor(Shape shape, memory::Category category)
      : shape_(std::move(shape)),
        data_(static_cast<std::size_t>(dsp::numel(shape_)), 0.0f, memory::CountingAllocator<float>(category)) {}
  /// Throws Error when the values do not fill the shape.
  Tensor(Shape shape, const std::vector<float>& values) : Tensor(std::move(shape), Storage(values.begin(), values.end())) {}
  Tensor(Shape shape, std::initializer_list<float> values) : Tensor(std::move(shape), Storage(values)) {}
  Tensor(Shape shape, Storage values) : shape_(std::move(shape)), data_(std::move(values)) {
    DSP_CHECK(static_cast<std::int64_t>(data_.size()) == dsp::numel(shape_), "Tensor: ", data_.size(),
              " values do not fill shape ", shape_str(shape_));
  }

  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(std::size_t i) const { return shape_.at(i); }
  std::size_t rank() const { return shape_.size(); }
  std::int64_t numel() const { return static_cast<std::int64_t>(data_.size()); }
  bool empty() const { return data_.empty(); }
  std::span<float> span() { return data_; }
  std::span<const float> span() const { return data_; }
  float& operator[](std::int64_t i) { return data_[static_cast<std::size_t>(i)]; }
  float operator[](std::int64_t i) const { return data_[static_cast<std::size_t>(i)]; }
  Storage& values() { return data_; }
  const Storage& values() const { return data_; }

  /// Same elements, new shape; throws Error when the element counts differ.
  Tensor& reshape(Shape shape) {
    DSP_CHECK(dsp::numel(shape) == numel(), "reshape ", shape_str(shape_), " -> ", shape_str(shape),
              ": element count differs");
    shape_ = std::move(shape);
    return *this;
  }
  void fill(float v) { std::fill(data_.begin(), data_.end(), v); }
  void zero() { fill(0.0f); }
  TensorView view() { return {data_.data(), shape_}; }
  operator TensorView() { return view(); }

 private:
  Shape shape_;
  Storage data_;
};
// Containers of tensors (std::vector<Tensor> growing) move them rather than copy them, so each
// keeps its storage and that storage's memory category.
static_assert(std::is_nothrow_move_constructible_v<Tensor>);

}  // namespace dsp
