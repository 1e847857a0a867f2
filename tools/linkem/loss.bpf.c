/* The link emulator's packet loss (tools/linkem/loss_model.h): a tc classifier in direct-action
 * mode on a veth's egress or ingress that drops IPv4 and IPv6 packets (ARP and the rest pass) at random, by
 * the model in `config`, with one generator per CPU in `state` (seeded by dynamiq-linkem). Built
 * with clang -target bpf; loaded and attached by tools/linkem/loss_filter.cc. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "loss_model.h"

struct {
  __uint(type, BPF_MAP_TYPE_ARRAY);
  __uint(max_entries, 1);
  __type(key, __u32);
  __type(value, struct dq_loss_config);
} config SEC(".maps");

struct {
  __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
  __uint(max_entries, 1);
  __type(key, __u32);
  __type(value, struct dq_loss_state);
} state SEC(".maps");

/* Packets seen and dropped, per CPU. */
struct dq_loss_counters {
  __u64 seen;
  __u64 dropped;
};
struct {
  __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
  __uint(max_entries, 1);
  __type(key, __u32);
  __type(value, struct dq_loss_counters);
} counters SEC(".maps");

SEC("tc")
int dq_loss(struct __sk_buff *skb) {
  if (skb->protocol != bpf_htons(ETH_P_IP) && skb->protocol != bpf_htons(ETH_P_IPV6)) return TC_ACT_OK;
  __u32 zero = 0;
  const struct dq_loss_config *c = bpf_map_lookup_elem(&config, &zero);
  struct dq_loss_state *s = bpf_map_lookup_elem(&state, &zero);
  struct dq_loss_counters *n = bpf_map_lookup_elem(&counters, &zero);
  if (!c || !s || !n) return TC_ACT_OK;
  n->seen++;
  if (!dq_loss_step(c, s)) return TC_ACT_OK;
  n->dropped++;
  return TC_ACT_SHOT;
}

char LICENSE[] SEC("license") = "GPL";
