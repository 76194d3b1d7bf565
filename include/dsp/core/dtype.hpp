#pragma once
// Element types: fp32 and bf16 (bfloat16 stored on the host, converted with round to
// nearest even). Arithmetic on bf16 is always done in fp32.
#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "dsp/core/error.hpp"

namespace dsp {

/// Element type tags used by tensors, communicators and checkpoints.
enum class DType : std::uint8_t { F32, BF16, I32, I64 };

/// Bytes of one element of dtype.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  return 0;
}

/// safetensors spelling of a dtype ("F32", "BF16", "I32", "I64").
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

/// Inverse of dtype_name; throws Error for an unknown name.
inline DType dtype_from_name(std::string_view name) {
  for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64})
    if (dtype_name(t) == name) return t;
  throw Error(detail::concat("unknown dtype '", name, "'"));
}

/// bfloat16: the upper 16 bits of an IEEE fp32. Conversion from float rounds to nearest,
/// ties to even; NaN stays NaN (quiet). Reference: Google Brain bfloat16 format.
struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static std::uint16_t from_float(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
  static float to_float(std::uint16_t b) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
  }
};

/// DType of a C++ element type.
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <>
constexpr DType dtype_of<std::int32_t>() { return DType::I32; }
template <>
constexpr DType dtype_of<std::int64_t>() { return DType::I64; }

/// Widens an element to the type reductions accumulate in (fp32 for bf16).
inline float to_accum(bf16 v) { return static_cast<float>(v); }
inline float to_accum(float v) { return v; }
inline double to_accum(double v) { return v; }
inline std::int64_t to_accum(std::int64_t v) { return v; }
inline std::int32_t to_accum(std::int32_t v) { return v; }

/// Narrows an accumulator back to T (round to nearest even for bf16).
template <class T, class A>
T from_accum(A a) {
  if constexpr (std::is_same_v<T, bf16>) return bf16(static_cast<float>(a));
  else return static_cast<T>(a);
}

}  // namespace dsp
