/* math.h for NVRTC: device code takes memcpy and the math functions from NVRTC
 * itself (see stdint.h here). */
#include <stddef.h>
