/* internal.h - helpers shared by the C sources; not part of the public ABI. */
#ifndef PRECIS_INTERNAL_H_
#define PRECIS_INTERNAL_H_

#include "precis/precis.h"

#if defined(__GNUC__)
#define PR_PRINTF(fmt_index, args_index) __attribute__((format(printf, fmt_index, args_index)))
#else
#define PR_PRINTF(fmt_index, args_index)
#endif

/* Record a formatted message as this thread's last error and return status.
 * Usage: return pr_fail(PRECIS_ERR_NULL_POINTER, "precis_accumulate: dst is NULL"); */
precis_status_t pr_fail(precis_status_t status, const char* fmt, ...) PR_PRINTF(2, 3);

/* Clear this thread's last error; every public entry point calls it first. */
void pr_clear_error(void);

/* Name of a dtype for messages, "<invalid dtype N>" style text for bad codes
 * (static or thread-local storage; never NULL). */
const char* pr_dtype_label(int dtype);

/* 1 if dtype is a valid precis_dtype_t code. */
int pr_dtype_valid(int dtype);

/* src without leading and trailing whitespace, lowercased, into dst (cap bytes
 * with the terminator); 0 if it does not fit. How names and values given as
 * text are compared (dtype.c, policy.c). */
int pr_normalize(const char* src, char* dst, size_t cap);

/* Every name (aliases included, canonical first) of the dtypes in mask (bit d: dtype
 * code d), comma-separated, into buf (cap bytes, truncated to fit). */
void pr_dtype_names(uint32_t mask, char* buf, size_t cap);

/* PRECIS_OK if ptr is aligned to the elements of dtype (the kernels read and
 * write it as an array of them), else INVALID_ARGUMENT naming it as
 * "name[index]" ("name" for index < 0). */
precis_status_t pr_check_aligned(const char* fn, const char* name, long long index,
                                 const void* ptr, int dtype);

/* [a, a + na) and [b, b + nb) share a byte (NULL or empty ranges never do). */
static inline int pr_overlap(const void* a, size_t na, const void* b, size_t nb) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return a != NULL && b != NULL && na > 0 && nb > 0 && x < y + nb && y < x + na;
}

#endif /* PRECIS_INTERNAL_H_ */
