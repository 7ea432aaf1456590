/*
 * torch_stable_abi.h - the part of libtorch's stable C ABI the glue uses,
 * declared here in plain C (torch's own headers are C++ only).
 *
 * The glue does not link libtorch: pr_torch_resolve() looks every function up
 * in the libtorch that is already loaded in the process. Each function is one
 * line of PR_TORCH_CPU_FUNCTIONS / PR_TORCH_CUDA_FUNCTIONS, which generates its
 * type (pr_<name>_fn), its slot in pr_torch and its lookup;
 * torch_stable_abi_check.cc compiles the same lines against the installed
 * torch's real headers and fails the build if any declaration drifts.
 */
#ifndef PRECIS_TORCH_STABLE_ABI_H_
#define PRECIS_TORCH_STABLE_ABI_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* torch's handle types: pointers to opaque objects. */
typedef int32_t AOTITorchError; /* 0 = success */
typedef uint64_t StableIValue;  /* one argument / result slot of a boxed kernel */
typedef struct AtenTensorOpaque* AtenTensorHandle;
typedef struct StableListOpaque* StableListHandle;
typedef struct TorchLibraryOpaque* TorchLibraryHandle;
typedef struct DeviceGuardOpaque* DeviceGuardHandle;
typedef void (*pr_boxed_kernel_fn)(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);

/* The ABI version torch_library_impl is told the glue was built for: 2.10, the
 * first that passes Tensor[] to a boxed kernel; later torches honour it. */
#define PR_TORCH_ABI_2_10 ((2ull << 56) | (10ull << 48))

/* X(name, return type, (parameter list)) for each function of libtorch_cpu.so. */
#define PR_TORCH_CPU_FUNCTIONS(X)                                                              \
  X(aoti_torch_abi_version, uint64_t, (void))                                                  \
  X(aoti_torch_library_init_fragment, AOTITorchError,                                          \
    (const char* ns, const char* file, uint32_t line, TorchLibraryHandle* ret_new_torch_lib))  \
  X(aoti_torch_library_init_impl, AOTITorchError,                                              \
    (const char* ns, const char* k, const char* file, uint32_t line,                           \
     TorchLibraryHandle* ret_new_torch_lib))                                                   \
  X(aoti_torch_library_def, AOTITorchError, (TorchLibraryHandle self, const char* schema))     \
  X(torch_library_impl, AOTITorchError,                                                        \
    (TorchLibraryHandle self, const char* name,                                                \
     void (*fn)(StableIValue*, uint64_t, uint64_t), uint64_t extension_build_version))         \
  X(aoti_torch_delete_library_object, AOTITorchError, (TorchLibraryHandle tlh))                \
  X(aoti_torch_check, void,                                                                    \
    (bool cond, const char* func, const char* file, uint32_t line, const char* msg))           \
  X(aoti_torch_delete_tensor_object, AOTITorchError, (AtenTensorHandle tensor))                \
  X(aoti_torch_get_data_ptr, AOTITorchError, (AtenTensorHandle tensor, void** ret_data_ptr))   \
  X(aoti_torch_get_numel, AOTITorchError, (AtenTensorHandle tensor, int64_t * ret_numel))      \
  X(aoti_torch_get_dim, AOTITorchError, (AtenTensorHandle tensor, int64_t * ret_dim))          \
  X(aoti_torch_get_sizes, AOTITorchError, (AtenTensorHandle tensor, int64_t * *ret_sizes))     \
  X(aoti_torch_get_dtype, AOTITorchError, (AtenTensorHandle tensor, int32_t * ret_dtype))      \
  X(aoti_torch_get_device_type, AOTITorchError,                                                \
    (AtenTensorHandle tensor, int32_t * ret_device_type))                                      \
  X(aoti_torch_get_device_index, AOTITorchError,                                               \
    (AtenTensorHandle tensor, int32_t * ret_device_index))                                     \
  X(aoti_torch_is_contiguous, AOTITorchError,                                                  \
    (AtenTensorHandle tensor, bool* ret_is_contiguous))                                        \
  X(aoti_torch_empty_strided, AOTITorchError,                                                  \
    (int64_t ndim, const int64_t* sizes_ptr, const int64_t* strides_ptr, int32_t dtype,        \
     int32_t device_type, int32_t device_index, AtenTensorHandle* ret_new_tensor))             \
  X(aoti_torch_zero_, AOTITorchError, (AtenTensorHandle self))                                 \
  X(aoti_torch_create_device_guard, AOTITorchError,                                            \
    (int32_t device_index, DeviceGuardHandle * ret_guard))                                     \
  X(aoti_torch_delete_device_guard, AOTITorchError, (DeviceGuardHandle guard))                 \
  X(torch_list_size, AOTITorchError, (StableListHandle list_handle, size_t * size))            \
  X(torch_list_get_item, AOTITorchError,                                                       \
    (StableListHandle list_handle, size_t index, StableIValue * element))                      \
  X(torch_delete_list, AOTITorchError, (StableListHandle list_handle))                         \
  X(torch_new_list_reserve_size, AOTITorchError, (size_t size, StableListHandle * ret))        \
  X(torch_list_push_back, AOTITorchError, (StableListHandle list_handle, StableIValue element)) \
  X(aoti_torch_new_tensor_handle, AOTITorchError,                                              \
    (AtenTensorHandle orig_handle, AtenTensorHandle * new_handle))                             \
  X(aoti_torch_dtype_float32, int32_t, (void))                                                 \
  X(aoti_torch_dtype_float16, int32_t, (void))                                                 \
  X(aoti_torch_dtype_bfloat16, int32_t, (void))                                                \
  X(aoti_torch_dtype_float64, int32_t, (void))                                                 \
  X(aoti_torch_dtype_uint8, int32_t, (void))                                                   \
  X(aoti_torch_dtype_int16, int32_t, (void))                                                   \
  X(aoti_torch_dtype_int32, int32_t, (void))                                                   \
  X(aoti_torch_dtype_int64, int32_t, (void))                                                   \
  X(aoti_torch_device_type_cpu, int32_t, (void))                                               \
  X(aoti_torch_device_type_cuda, int32_t, (void))

/* ... and of libtorch_cuda.so (present only in a CUDA build of torch). */
#define PR_TORCH_CUDA_FUNCTIONS(X) \
  X(aoti_torch_get_current_cuda_stream, AOTITorchError, (int32_t device_index, void** ret_stream))

#define PR_TORCH_DECLARE_TYPE(name, ret, params) typedef ret pr_##name##_fn params;
PR_TORCH_CPU_FUNCTIONS(PR_TORCH_DECLARE_TYPE)
PR_TORCH_CUDA_FUNCTIONS(PR_TORCH_DECLARE_TYPE)
#undef PR_TORCH_DECLARE_TYPE

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PRECIS_TORCH_STABLE_ABI_H_ */
