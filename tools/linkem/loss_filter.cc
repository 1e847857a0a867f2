#include "tools/linkem/loss_filter.h"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <net/if.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tools/linkem/loss_model.h"

// loss.bpf.o, compiled by clang -target bpf at build time (tools/CMakeLists.txt), in .rodata.
asm(".section .rodata\n"
    ".balign 8\n"
    ".global dq_loss_bpf_begin\n"
    "dq_loss_bpf_begin:\n"
    ".incbin \"" DQ_LOSS_BPF_OBJECT
    "\"\n"
    ".global dq_loss_bpf_end\n"
    "dq_loss_bpf_end:\n"
    ".previous\n");
extern "C" const char dq_loss_bpf_begin[];
extern "C" const char dq_loss_bpf_end[];

namespace dynamiq::linkem {
namespace {

absl::Status Failed(absl::string_view what, int err) {
  return absl::FailedPreconditionError(absl::StrCat("loss filter: ", what, ": ", std::strerror(err < 0 ? -err : err)));
}

struct ObjectCloser {
  void operator()(bpf_object* o) const { bpf_object__close(o); }
};

}  // namespace

absl::Status AttachLossFilter(const std::string& device, const LossModel& loss, uint64_t seed, LossSide side) {
  const int ifindex = static_cast<int>(if_nametoindex(device.c_str()));
  if (ifindex == 0) return absl::InvalidArgumentError(absl::StrCat("loss filter: no device '", device, "' here"));
  libbpf_set_print(nullptr);  // errors are returned, not printed
  LIBBPF_OPTS(bpf_object_open_opts, open_opts, .object_name = "dq_loss");
  std::unique_ptr<bpf_object, ObjectCloser> obj(
      bpf_object__open_mem(dq_loss_bpf_begin, dq_loss_bpf_end - dq_loss_bpf_begin, &open_opts));
  if (obj == nullptr) return Failed("open the program", errno);
  if (int err = bpf_object__load(obj.get()); err != 0) return Failed("load the program (CAP_BPF?)", err);

  const uint32_t key = 0;
  const dq_loss_config config = loss.ToConfig();
  bpf_map* config_map = bpf_object__find_map_by_name(obj.get(), "config");
  bpf_map* state_map = bpf_object__find_map_by_name(obj.get(), "state");
  if (config_map == nullptr || state_map == nullptr) return Failed("find its maps", ENOENT);
  if (int err = bpf_map__update_elem(config_map, &key, sizeof(key), &config, sizeof(config), BPF_ANY); err != 0) {
    return Failed("set the loss model", err);
  }
  const int cpus = libbpf_num_possible_cpus();
  if (cpus <= 0) return Failed("count the CPUs", cpus);
  std::vector<dq_loss_state> states(cpus);
  for (int cpu = 0; cpu < cpus; ++cpu) states[cpu] = {dq_loss_seed(seed, static_cast<dq_u32>(cpu)), 0, 0};
  if (int err =
          bpf_map__update_elem(state_map, &key, sizeof(key), states.data(), states.size() * sizeof(states[0]), BPF_ANY);
      err != 0) {
    return Failed("seed the generators", err);
  }

  bpf_program* program = bpf_object__find_program_by_name(obj.get(), "dq_loss");
  if (program == nullptr) return Failed("find the program", ENOENT);
  LIBBPF_OPTS(bpf_tc_hook, hook, .ifindex = ifindex,
              .attach_point = side == LossSide::kIngress ? BPF_TC_INGRESS : BPF_TC_EGRESS);
  if (int err = bpf_tc_hook_create(&hook); err != 0 && err != -EEXIST) {
    return Failed(absl::StrCat("create the clsact qdisc on ", device), err);
  }
  LIBBPF_OPTS(bpf_tc_opts, attach, .prog_fd = bpf_program__fd(program), .flags = BPF_TC_F_REPLACE, .handle = 1,
              .priority = 1);
  if (int err = bpf_tc_attach(&hook, &attach); err != 0) {
    return Failed(absl::StrCat("attach to ", device, side == LossSide::kIngress ? "'s ingress" : "'s egress"), err);
  }
  return absl::OkStatus();
}

}  // namespace dynamiq::linkem
