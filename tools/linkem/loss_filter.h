// AttachLossFilter: random packet loss on a network device's egress or ingress, by the link
// emulator's model (tools/linkem/loss_model.h): loads loss.bpf.c (compiled into this binary) and
// attaches it as a tc classifier in direct-action mode under the device's clsact qdisc (created if missing; a loss
// filter already there is replaced). The filter stays when this process exits; deleting the
// device, its namespace or its clsact qdisc removes it. Needs CAP_NET_ADMIN and CAP_BPF (root).
#ifndef DQ_TOOLS_LINKEM_LOSS_FILTER_H_
#define DQ_TOOLS_LINKEM_LOSS_FILTER_H_

#include <stdint.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/linkem/link_settings.h"

namespace dynamiq::linkem {

// INVALID_ARGUMENT for an unknown device; FAILED_PRECONDITION (with the kernel's reason) when the
// program cannot be loaded or attached.
enum class LossSide { kEgress, kIngress };
absl::Status AttachLossFilter(const std::string& device, const LossModel& loss, uint64_t seed,
                              LossSide side = LossSide::kEgress);

}  // namespace dynamiq::linkem

#endif  // DQ_TOOLS_LINKEM_LOSS_FILTER_H_
