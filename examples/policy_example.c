/* policy_example.c - the precision policy from plain C: defaults for a bf16
 * model, then YAML-style string overrides, with the error a typo gets.
 * bazel run //examples:policy_example */
#include <stdio.h>

#include "precis/precis.h"

static void print_policy(const char* title, const precis_policy_t* p) {
  const char* names[6];
  precis_dtype_name(p->param_dtype, &names[0]);
  precis_dtype_name(p->main_params_dtype, &names[1]);
  precis_dtype_name(p->main_grads_dtype, &names[2]);
  precis_dtype_name(p->grad_comm_dtype, &names[3]);
  precis_dtype_name(p->exp_avg_dtype, &names[4]);
  precis_dtype_name(p->exp_avg_sq_dtype, &names[5]);
  printf("%-28s param=%s master=%s main_grads=%s comm=%s exp_avg=%s exp_avg_sq=%s "
         "remainders=%d\n",
         title, names[0], names[1], names[2], names[3], names[4], names[5],
         p->store_param_remainders);
}

int main(void) {
  precis_policy_t policy = PRECIS_POLICY_INIT;
  if (precis_policy_defaults(PRECIS_DTYPE_BF16, &policy) != PRECIS_OK) {
    fprintf(stderr, "defaults: %s\n", precis_last_error());
    return 1;
  }
  print_policy("bf16 defaults:", &policy);

  const char* fields[] = {"exp_avg_dtype", "exp_avg_sq_dtype", "store_param_remainders"};
  const char* values[] = {"FP8", " float8 ", "true"};
  precis_status_t st = precis_policy_resolve(PRECIS_DTYPE_BF16, fields, values, 3, &policy);
  if (st != PRECIS_OK) {
    fprintf(stderr, "resolve: %s\n", precis_last_error());
    return 1;
  }
  print_policy("bf16 + fp8 moments + rem.:", &policy);

  st = precis_policy_set(&policy, "exp_avg_dtype", "bf17");
  printf("a typo is refused (%s): %s\n", precis_status_string(st), precis_last_error());
  return st == PRECIS_ERR_INVALID_DTYPE ? 0 : 1;
}
