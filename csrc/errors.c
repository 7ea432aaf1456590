/* errors.c - status strings, the thread-local last-error message, version.
 * (pr_dtype_label and pr_dtype_valid live in dtype.c, next to the name table.) */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

/* One message per thread: a failing call on one thread never clobbers another's. */
static _Thread_local char pr_last_error[1024];

precis_status_t pr_fail(precis_status_t status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(pr_last_error, sizeof pr_last_error, fmt, args);
  va_end(args);
  return status;
}

void pr_clear_error(void) { pr_last_error[0] = '\0'; }

PRECIS_API const char* precis_status_string(precis_status_t status) {
  static const char* const strings[PRECIS_STATUS_COUNT] = {
      "success",
      "a required pointer argument is NULL",
      "invalid argument",
      "invalid dtype",
      "invalid precision policy",
      "size mismatch",
      "unsupported in this build",
      "CUDA error",
      "out of memory",
  };
  /* Compare as int: an out-of-range value may not fit the enum's range. */
  if ((int)status < 0 || (int)status >= (int)PRECIS_STATUS_COUNT) return "unknown status";
  return strings[status];
}

PRECIS_API const char* precis_last_error(void) { return pr_last_error; }

PRECIS_API int precis_version(void) { return PRECIS_VERSION_CODE; }
