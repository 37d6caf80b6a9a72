// fusegen-rtc.h: what the kernels take from the C++ standard library, for NVRTC, which
// compiles the same kernel sources at run time (fusegen-rtc.cpp) and ships no standard
// header. Included instead of <cstdint>, <cstring>, <cmath> and <type_traits> when
// __CUDACC_RTC__ is defined; the sizes are those of the x86-64 and aarch64 hosts, so that a
// struct the host fills and a kernel reads has one layout on both sides.
#ifndef FUSEGEN_RTC_H_
#define FUSEGEN_RTC_H_

typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long uintptr_t;

#define UINT16_C(c) c
#define UINT32_C(c) c##U
#define INT64_C(c) c##L
#define UINT64_C(c) c##UL

// <cmath>'s constants, which the printed math spells (a row op's maximum starts at -INFINITY).
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)

namespace std {

using ::int64_t;
using ::uint16_t;
using ::uint32_t;
using ::uint64_t;
using ::uintptr_t;

template <typename T, T kValue>
struct integral_constant {
  static constexpr T value = kValue;
};
using true_type = integral_constant<bool, true>;
using false_type = integral_constant<bool, false>;

template <typename A, typename B> struct is_same : false_type {};
template <typename A> struct is_same<A, A> : true_type {};
template <typename A, typename B> constexpr bool is_same_v = is_same<A, B>::value;

template <bool kIf, typename A, typename B> struct conditional { using type = A; };
template <typename A, typename B> struct conditional<false, A, B> { using type = B; };
template <bool kIf, typename A, typename B>
using conditional_t = typename conditional<kIf, A, B>::type;

template <typename T> struct make_signed;
template <> struct make_signed<uint32_t> { using type = int32_t; };
template <> struct make_signed<uint64_t> { using type = int64_t; };
template <typename T> using make_signed_t = typename make_signed<T>::type;

__device__ __forceinline__ void* memcpy(void* to, const void* from, size_t n) {
  return ::memcpy(to, from, n);
}
__device__ __forceinline__ float fabs(float x) { return ::fabsf(x); }
__device__ __forceinline__ double fabs(double x) { return ::fabs(x); }
__device__ __forceinline__ bool isnan(float x) { return ::isnan(x); }
__device__ __forceinline__ bool isnan(double x) { return ::isnan(x); }

}  // namespace std

#endif  // FUSEGEN_RTC_H_
