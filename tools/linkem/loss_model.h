/* The link emulator's packet loss, shared by the eBPF filter that drops packets on a veth's egress
 * (loss.bpf.c, kernel side) and the C++ code that configures and tests it (user side): one random
 * generator and one Gilbert-Elliott step, in C that both compilers take.
 *
 * Probabilities are fixed point: p * 2^32, saturated at 0xffffffff (p = 1 drops every packet).
 * Bernoulli loss is the Gilbert-Elliott chain with p_gb = 0 (it never leaves the good state) and
 * loss_good = p. Gilbert-Elliott (bursts): in the good state a packet is lost with loss_good, in
 * the bad state with loss_bad; after each packet the chain moves good -> bad with p_gb and bad ->
 * good with p_bg. Mean loss = (p_gb * loss_bad + p_bg * loss_good) / (p_gb + p_bg); mean burst
 * length (loss_bad = 1) = 1 / p_bg packets. */
#ifndef DQ_TOOLS_LINKEM_LOSS_MODEL_H_
#define DQ_TOOLS_LINKEM_LOSS_MODEL_H_

#ifdef __cplusplus
#include <cstdint>
typedef uint32_t dq_u32;
typedef uint64_t dq_u64;
#else
typedef __u32 dq_u32;
typedef __u64 dq_u64;
#endif

struct dq_loss_config {
  dq_u32 loss_good; /* loss probability in the good state */
  dq_u32 loss_bad;  /* ... in the bad state */
  dq_u32 p_gb;      /* good -> bad after a packet */
  dq_u32 p_bg;      /* bad -> good after a packet */
};

/* The chain's state and the generator (one per CPU in the kernel). */
struct dq_loss_state {
  dq_u64 rng; /* xorshift64*, never 0 */
  dq_u32 bad; /* 1 in the bad state */
  dq_u32 pad;
};

/* xorshift64* (Vigna): 32 good random bits per call. */
static inline dq_u32 dq_loss_random(struct dq_loss_state* s) {
  dq_u64 x = s->rng;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  s->rng = x;
  return (dq_u32)((x * 0x2545F4914F6CDD1Dull) >> 32);
}

/* Whether the next packet is lost; advances the chain. */
static inline int dq_loss_step(const struct dq_loss_config* c, struct dq_loss_state* s) {
  const dq_u32 p = s->bad ? c->loss_bad : c->loss_good;
  const int lost = p == 0xffffffffu || dq_loss_random(s) < p;
  const dq_u32 move = s->bad ? c->p_bg : c->p_gb;
  if (move != 0 && (move == 0xffffffffu || dq_loss_random(s) < move)) s->bad = !s->bad;
  return lost;
}

/* A seed's generator state (never 0). */
static inline dq_u64 dq_loss_seed(dq_u64 seed, dq_u32 cpu) {
  dq_u64 z = seed + 0x9E3779B97F4A7C15ull * (dq_u64)(cpu + 1); /* splitmix64 */
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z ? z : 1;
}

#endif /* DQ_TOOLS_LINKEM_LOSS_MODEL_H_ */
