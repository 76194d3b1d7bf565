#pragma once
// Element types: fp32, bf16 (bfloat16) and fp16 (IEEE binary16), the 16-bit ones stored as
// their bits and converted from float with round to nearest even (the same functions on the host
// and in CUDA kernels). Arithmetic on bf16 and fp16 is always done in fp32.
#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "dsp/core/error.hpp"
#include "dsp/core/host_device.hpp"

namespace dsp {

namespace detail {
/// The bits of a float and back (std::bit_cast on the host, CUDA's intrinsics in device code),
/// for the conversions below, which both backends share.
DSP_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
DSP_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}
}  // namespace detail

/// Element type tags used by tensors, communicators and checkpoints. F16 and F8_E4M3 are
/// storage types of imported checkpoints only (read and widened to fp32; see fp16 and
/// fp8_e4m3).
enum class DType : std::uint8_t { F32, BF16, I32, I64, F16, F8_E4M3 };

/// Bytes of one element of dtype.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::F16: return 2;
    case DType::F8_E4M3: return 1;
  }
  return 0;
}

/// safetensors spelling of a dtype ("F32", "BF16", "I32", "I64", "F16", "F8_E4M3").
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F16: return "F16";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

/// Inverse of dtype_name; throws Error for an unknown name.
inline DType dtype_from_name(std::string_view name) {
  for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64, DType::F16, DType::F8_E4M3})
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

  DSP_HOST_DEVICE static std::uint16_t from_float(float f) {
    const std::uint32_t u = detail::float_bits(f);
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const std::uint32_t quiet_nan = (u >> 16) | 0x0040u;
    // A select, not a branch, so that loops of conversions vectorise (signed compare: SSE2 has
    // no unsigned one; both sides are non-negative).
    const bool nan = static_cast<std::int32_t>(u & 0x7fffffffu) > 0x7f800000;
    return static_cast<std::uint16_t>(nan ? quiet_nan : rounded);
  }
  DSP_HOST_DEVICE static float to_float(std::uint16_t b) { return detail::bits_float(static_cast<std::uint32_t>(b) << 16); }
};

/// fp16: IEEE 754 binary16 (1 sign, 5 exponent bits with bias 15, 10 mantissa bits; largest
/// finite 65504, smallest normal 2^-14, smallest subnormal 2^-24). Conversion from float rounds
/// to nearest, ties to even, including into the subnormal range; values of magnitude >= 65520
/// (65504 + half a unit in the last place) become infinity; NaN becomes a quiet NaN (payload
/// bits 13-22 kept, quiet bit set). Conversion to float is exact. Both are correct whatever the
/// FPU's flush-to-zero / denormals-are-zero modes (the only float arithmetic, in the subnormal
/// paths, has normal operands and results). DType::F16: checkpoints read it (imported models), never write it.
/// Reference: F. Giesen, "float->half variants" (float_to_half_fast3_rtne), public domain.
struct fp16 {
  std::uint16_t bits = 0;

  constexpr fp16() = default;
  explicit fp16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  DSP_HOST_DEVICE static std::uint16_t from_float(float f) {
    std::uint32_t u = detail::float_bits(f);
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    std::uint32_t h;
    if (u >= 0x47800000u) {  // |f| >= 2^16, inf or NaN: all exponent bits set
      h = u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x03ffu) : 0x7c00u;
    } else if (u < 0x38800000u) {  // |f| < 2^-14: fp16 subnormal or zero
      // Adding 0.5 puts the 2^-24 unit of fp16 subnormals at fp32's last mantissa bit, so the
      // float addition rounds (to nearest even) exactly where fp16 must; subtracting 0.5's
      // bits leaves the fp16 bit pattern (0x400 when it rounds up to the smallest normal).
      h = detail::float_bits(detail::bits_float(u) + 0.5f) - 0x3f000000u;
    } else {  // normal: rebias the exponent by 15 - 127 and round 23 -> 10 mantissa bits
      const std::uint32_t odd = (u >> 13) & 1u;
      h = (u - 0x38000000u + 0x0fffu + odd) >> 13;  // a carry into exponent 31 gives infinity
    }
    return static_cast<std::uint16_t>(sign | h);
  }
  DSP_HOST_DEVICE static float to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x03ffu;
    if (exp == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN
    if (exp != 0) return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
    const float sub = static_cast<float>(mant) * 0x1.0p-24f;  // zero or subnormal: exact
    return sign ? -sub : sub;
  }
};

/// fp8 e4m3 ("E4M3FN", Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; torch's
/// float8_e4m3fn): 1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, the
/// largest finite 448, S.1111.111 is NaN, smallest normal 2^-6, subnormals m x 2^-9. Only decoded
/// (exactly) here: DeepSeek-V3's FP8 weights are dequantised to fp32 on import.
struct fp8_e4m3 {
  static float to_float(std::uint8_t b) {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t exp = (b >> 3) & 0x0fu, mant = b & 0x07u;
    if (exp == 0x0fu && mant == 0x07u) return detail::bits_float(sign | 0x7fc00000u);  // NaN
    if (exp != 0) return detail::bits_float(sign | ((exp + 120u) << 23) | (mant << 20));  // rebias 7 -> 127
    const float sub = static_cast<float>(mant) * 0x1.0p-9f;  // zero or subnormal: exact
    return sign ? -sub : sub;
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

/// Widens an element to the type reductions accumulate in (fp32 for bf16 and fp16).
inline float to_accum(bf16 v) { return static_cast<float>(v); }
inline float to_accum(fp16 v) { return static_cast<float>(v); }
inline float to_accum(float v) { return v; }
inline double to_accum(double v) { return v; }
inline std::int64_t to_accum(std::int64_t v) { return v; }
inline std::int32_t to_accum(std::int32_t v) { return v; }

/// Narrows an accumulator back to T (round to nearest even for bf16 and fp16).
template <class T, class A>
T from_accum(A a) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) return T(static_cast<float>(a));
  else return static_cast<T>(a);
}

}  // namespace dsp
