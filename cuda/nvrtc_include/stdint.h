/* stdint.h for NVRTC, which has no C library headers: the fixed-width types of
 * x86-64 and aarch64 Linux (LP64, as the host code that shares these structs). Only
 * what csrc's headers use in device code; tools/build_cuda12.py puts this folder on
 * NVRTC's include path. */
#ifndef PRECIS_NVRTC_STDINT_H_
#define PRECIS_NVRTC_STDINT_H_
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;
#define INT32_MAX 2147483647
#define INT64_MAX 9223372036854775807L
#define INT64_MIN (-INT64_MAX - 1)
#define UINT32_MAX 4294967295U
#define UINT64_MAX 18446744073709551615UL
#define UINTPTR_MAX UINT64_MAX
#define INT64_C(c) c##L
#define UINT64_C(c) c##UL
#endif
