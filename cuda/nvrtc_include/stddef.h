/* stddef.h for NVRTC (see stdint.h here). */
#ifndef PRECIS_NVRTC_STDDEF_H_
#define PRECIS_NVRTC_STDDEF_H_
typedef unsigned long size_t;
typedef long ptrdiff_t;
#define NULL 0
#define offsetof(type, member) ((size_t) & (((type*)0)->member))
#endif
