// Helpers shared by the C tests (header-only): dtype shorthands, reading and
// writing elements of any dtype, the Adam dtype combinations and pointer
// tables, and Buf, a canary-guarded buffer that can start off alignment.
#ifndef PRECIS_TESTS_C_TEST_SUPPORT_H_
#define PRECIS_TESTS_C_TEST_SUPPORT_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "precis/precis.h"
#include "rules.h"
#include "stores.h"
#include "precis_convert.h"

namespace precis_test {

// ---- dtypes ---------------------------------------------------------------------------

constexpr precis_dtype_t F32 = PRECIS_DTYPE_FP32;
constexpr precis_dtype_t F16 = PRECIS_DTYPE_FP16;
constexpr precis_dtype_t B16 = PRECIS_DTYPE_BF16;
constexpr precis_dtype_t F8 = PRECIS_DTYPE_FP8_E4M3;
constexpr precis_dtype_t I16 = PRECIS_DTYPE_INT16;

// The dtype's name; "dtype<code>" for a code precis does not know (the tests
// pass bad codes on purpose).
inline std::string DName(precis_dtype_t d) {
  const char* n = nullptr;
  if (precis_dtype_name(d, &n) != PRECIS_OK) return "dtype" + std::to_string((int)d);
  return n;
}
inline size_t DSize(precis_dtype_t d) { return d == F32 ? 4 : d == F8 ? 1 : 2; }
// Moment dtypes stored with a per-block scale.
inline bool Scaled(precis_dtype_t d) { return d == F16 || d == F8; }
// Scale blocks (one scale each) of a tensor of n elements.
inline int64_t Blocks(int64_t n) { return (n + PRECIS_SCALE_BLOCK - 1) / PRECIS_SCALE_BLOCK; }

// ---- elements of any float dtype ------------------------------------------------------

// Element i of b (a Buf or a std::vector<uint8_t>) holding dtype d, as fp32;
// NaN for a dtype that is not a float one.
template <class Bytes>
float Decode(const Bytes& b, precis_dtype_t d, int64_t i) {
  const uint8_t* p = b.data();
  switch (d) {
    case F32: {
      float f;
      std::memcpy(&f, p + i * 4, 4);
      return f;
    }
    case F16:
    case B16: {
      uint16_t h;
      std::memcpy(&h, p + i * 2, 2);
      return d == F16 ? precis_f16_to_f32(h) : precis_bf16_to_f32(h);
    }
    case F8:
      return precis_fp8_to_f32(p[i]);
    default:
      return NAN;
  }
}

// Writes x to element i of b, rounded to nearest even; nothing for a dtype
// that is not a float one.
template <class Bytes>
void Encode(Bytes& b, precis_dtype_t d, int64_t i, float x) {
  uint8_t* p = b.data();
  switch (d) {
    case F32:
      std::memcpy(p + i * 4, &x, 4);
      break;
    case F16:
    case B16: {
      const uint16_t h = d == F16 ? precis_f32_to_f16_rn(x) : precis_f32_to_bf16_rn(x);
      std::memcpy(p + i * 2, &h, 2);
      break;
    }
    case F8:
      p[i] = precis_f32_to_fp8_rn(x);
      break;
    default:
      break;
  }
}

// ---- Adam dtype combinations ----------------------------------------------------------

struct Combo {
  precis_dtype_t pd, gd, md, ed, sd;  // params, grads, master, exp_avg, exp_avg_sq
};

// How a combination keeps its master weights: none (the params themselves), a
// separate tensor, or int16 or 8-bit (the fp8 code's bytes) remainders of bf16 params.
enum Mode { kNone, kSeparate, kRemainder, kRemainder8 };
inline Mode ModeOf(const Combo& c) {
  if (c.md == c.pd) return kNone;
  if (c.md == F8 && c.pd == B16) return kRemainder8;
  return c.md == I16 ? kRemainder : kSeparate;
}

// The fp32 master value of element i of a tensor whose param bytes (dtype pd) and
// master bytes (dtype md) keep it as `mode` says.
template <class Bytes>
float MasterValue(const Bytes& param, const Bytes& master, Mode mode, precis_dtype_t pd,
                  precis_dtype_t md, int64_t i) {
  switch (mode) {
    case kNone:
      return Decode(param, pd, i);
    case kSeparate:
      return Decode(master, md, i);
    case kRemainder: {
      uint16_t p;
      int16_t r;
      std::memcpy(&p, &param[i * 2], 2);
      std::memcpy(&r, &master[i * 2], 2);
      return precis_remainder_master(p, r);
    }
    case kRemainder8: {
      uint16_t p;
      std::memcpy(&p, &param[i * 2], 2);
      return precis_remainder8_master(p, static_cast<int8_t>(master[i]));
    }
  }
  return NAN;
}

// Set element i's master to x (and the param to its rounding), as the kernel stores it.
template <class Bytes>
void SetMasterValue(Bytes& param, Bytes& master, Mode mode, precis_dtype_t pd,
                    precis_dtype_t md, int64_t i, float x) {
  switch (mode) {
    case kNone:
      Encode(param, pd, i, x);
      break;
    case kSeparate:
      Encode(master, md, i, x);
      Encode(param, pd, i, Decode(master, md, i));
      break;
    case kRemainder: {
      const uint16_t p = precis_remainder_param(x);
      const int16_t r = precis_remainder_low(x);
      std::memcpy(&param[i * 2], &p, 2);
      std::memcpy(&master[i * 2], &r, 2);
      break;
    }
    case kRemainder8: {
      const uint16_t p = precis_remainder8_param(x);
      std::memcpy(&param[i * 2], &p, 2);
      master[i] = static_cast<uint8_t>(precis_remainder8_low(x));
      break;
    }
  }
}

inline std::string ComboName(const Combo& c) {
  std::string master = c.md == c.pd ? "none" : DName(c.md);
  return "p_" + DName(c.pd) + "_g_" + DName(c.gd) + "_master_" + master + "_m_" + DName(c.ed) +
         "_v_" + DName(c.sd);
}

// Every combination the CPU kernel accepts: params x master x grads x
// exp_avg x exp_avg_sq.
inline std::vector<Combo> AllCombos() {
  std::vector<Combo> out;
  const precis_dtype_t floats[] = {F32, F16, B16};
  const precis_dtype_t moments[] = {F32, F16, B16, F8};
  for (precis_dtype_t pd : floats) {
    std::vector<precis_dtype_t> masters = {pd};  // none (bf16: stochastic rounding)
    if (pd != F32) masters.push_back(F32);
    if (pd == B16) {
      masters.push_back(F16);
      masters.push_back(I16);  // remainders
      masters.push_back(F8);   // 8-bit remainders
    }
    for (precis_dtype_t md : masters)
      for (precis_dtype_t gd : floats)
        for (precis_dtype_t ed : moments)
          for (precis_dtype_t sd : moments) out.push_back({pd, gd, md, ed, sd});
  }
  return out;
}

// The pointer tables of a precis_step_tensors_t, an entry a tensor, filled by
// Clear() and Add() (and AddMax() for AMSGrad's running max); tests may spoil
// an entry after Describe() to check that the kernels reject it.
struct AdamTables {
  std::vector<void*> params, masters, ms, vs, vmaxs;
  std::vector<const void*> grads;
  std::vector<float*> m_scales, v_scales, vmax_scales;
  std::vector<int64_t> numels, steps;

  void Clear() {
    params.clear(), masters.clear(), ms.clear(), vs.clear(), grads.clear();
    m_scales.clear(), v_scales.clear(), numels.clear(), steps.clear();
    vmaxs.clear(), vmax_scales.clear();
  }
  void AddMax(void* vmax, float* vmax_scale) {
    vmaxs.push_back(vmax);
    vmax_scales.push_back(vmax_scale);
  }
  void Add(void* param, const void* grad, void* master, void* m, void* v, float* m_scale,
           float* v_scale, int64_t numel, int64_t step) {
    params.push_back(param);
    grads.push_back(grad);
    masters.push_back(master);
    ms.push_back(m);
    vs.push_back(v);
    m_scales.push_back(m_scale);
    v_scales.push_back(v_scale);
    numels.push_back(numel);
    steps.push_back(step);
  }
  // The tensors of combination c over the tables: no masters or scales table
  // where c has none.
  precis_step_tensors_t Describe(const Combo& c) {
    precis_step_tensors_t d = PRECIS_STEP_TENSORS_INIT;
    d.count = params.size();
    d.param_dtype = c.pd;
    d.grad_dtype = c.gd;
    d.master_dtype = c.md;
    d.exp_avg_dtype = c.ed;
    d.exp_avg_sq_dtype = c.sd;
    d.params = params.data();
    d.grads = grads.data();
    d.masters = ModeOf(c) == kNone ? nullptr : masters.data();
    d.exp_avgs = ms.data();
    d.exp_avg_sqs = vs.data();
    d.exp_avg_scales = Scaled(c.ed) ? m_scales.data() : nullptr;
    d.exp_avg_sq_scales = Scaled(c.sd) ? v_scales.data() : nullptr;
    d.numels = numels.data();
    d.steps = steps.data();
    if (!vmaxs.empty()) {
      d.max_exp_avg_sqs = vmaxs.data();
      d.max_exp_avg_sq_scales = Scaled(c.sd) ? vmax_scales.data() : nullptr;
    }
    return d;
  }
};

// ---- buffers --------------------------------------------------------------------------

// Memory of exactly `bytes` bytes that starts `offset` bytes into a 64-byte
// aligned allocation. The `offset` bytes before it and one byte after it are
// canaries that must stay intact; ASan reports any access past that one.
// A default-constructed Buf is empty: data() is null.
class Buf {
 public:
  static constexpr uint8_t kCanary = 0xA5;

  Buf() = default;
  Buf(size_t bytes, size_t offset) : bytes_(bytes), offset_(offset) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, offset + bytes + 1) != 0) abort();  // +1: never empty
    base_ = static_cast<uint8_t*>(p);
    std::memset(base_, kCanary, offset + bytes + 1);
    std::memset(data(), 0, bytes);
  }
  Buf(const Buf& o) : bytes_(o.bytes_), offset_(o.offset_) {
    if (o.base_ == nullptr) return;
    if (posix_memalign(reinterpret_cast<void**>(&base_), 64, offset_ + bytes_ + 1) != 0) abort();
    std::memcpy(base_, o.base_, offset_ + bytes_ + 1);
  }
  Buf(Buf&& o) noexcept { *this = std::move(o); }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    std::swap(offset_, o.offset_);
    return *this;
  }
  Buf& operator=(const Buf&) = delete;
  ~Buf() { free(base_); }

  uint8_t* data() const { return base_ == nullptr ? nullptr : base_ + offset_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return base_ == nullptr; }
  bool CanaryIntact() const {
    for (size_t i = 0; i < offset_; ++i)
      if (base_[i] != kCanary) return false;
    return base_ == nullptr || base_[offset_ + bytes_] == kCanary;
  }
  // The same bytes (the offsets and canaries may differ).
  bool operator==(const Buf& o) const {
    return bytes_ == o.bytes_ && (bytes_ == 0 || std::memcmp(data(), o.data(), bytes_) == 0);
  }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0, offset_ = 0;
};

// x and y (elements of dtype d; what: their name in the message) hold the same bytes
// and their canaries are intact; else a failure naming the first differing elements.
inline ::testing::AssertionResult SameBuf(const std::string& what, const Buf& x, const Buf& y,
                                          precis_dtype_t d) {
  if (!x.CanaryIntact() || !y.CanaryIntact()) {
    return ::testing::AssertionFailure() << what << ": a write outside the buffer";
  }
  if (x.bytes() == 0 || std::memcmp(x.data(), y.data(), x.bytes()) == 0) {
    return ::testing::AssertionSuccess();
  }
  const size_t es = DSize(d);
  const size_t count = x.bytes() / es;
  auto f = ::testing::AssertionFailure();
  f << what << " (" << DName(d) << ") differs:";
  int shown = 0;
  size_t differing = 0;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(x.data() + i * es, y.data() + i * es, es) == 0) continue;
    ++differing;
    if (shown++ < 4) {
      uint32_t ux = 0, uy = 0;
      std::memcpy(&ux, x.data() + i * es, es);
      std::memcpy(&uy, y.data() + i * es, es);
      char buf[160];
      snprintf(buf, sizeof buf, " [%zu] 0x%x (%.9g) vs 0x%x (%.9g);", i, ux,
               (double)Decode(x, d, (int64_t)i), uy, (double)Decode(y, d, (int64_t)i));
      f << buf;
    }
  }
  return f << " " << differing << " of " << count << " elements";
}

// Gradients whose fp8 moment stores meet every input: with beta1 = beta2 = 0 the
// new m is g and sqrt(v) is |g|, and each 128-block starts with 7.875 (m's block
// multiplier 1, v's 126 / 7.875 = 16, both exact). *inputs: every m8 code's
// value and the midpoint to the next, both signs, zeros and a bf16 subnormal; the
// gradients hold them `copies` times (each element its own random bits), then a
// last block with a NaN. All are bf16 values.
inline std::vector<float> Fp8StoreGrads(int copies, std::vector<float>* inputs) {
  uint32_t subnormal = 0x00400000u;
  float sub;
  std::memcpy(&sub, &subnormal, 4);
  *inputs = {0.0f, -0.0f, sub};
  for (uint32_t c = 0; c < PRECIS_M8_MAX_CODE; ++c) {
    const float lo = precis_m8_to_f32(static_cast<uint8_t>(c));
    const float mid = 0.5f * (lo + precis_m8_to_f32(static_cast<uint8_t>(c + 1)));
    for (float x : {lo, -lo, mid, -mid}) inputs->push_back(x);
  }
  std::vector<float> grads;
  for (int k = 0; k < copies; ++k) {
    for (float x : *inputs) {
      if (grads.size() % PRECIS_SCALE_BLOCK == 0) grads.push_back(PRECIS_M8_MAX);
      grads.push_back(x);
    }
  }
  while (grads.size() % PRECIS_SCALE_BLOCK != 0) grads.push_back(0.0f);
  grads.push_back(NAN);  // the last block: its state is lost and says so
  grads.push_back(1.0f);
  return grads;
}

// precis_fingerprint of each of bufs' first nbytes[i] bytes, as they are now.
inline std::vector<uint64_t> Fingerprints(const std::vector<const void*>& bufs,
                                          const std::vector<int64_t>& nbytes) {
  std::vector<uint64_t> out(bufs.size());
  EXPECT_EQ(precis_fingerprint(bufs.data(), nbytes.data(), static_cast<int64_t>(bufs.size()),
                               out.data()),
            PRECIS_OK);
  return out;
}

}  // namespace precis_test

#endif  // PRECIS_TESTS_C_TEST_SUPPORT_H_
