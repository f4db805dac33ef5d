// oneshot.cu: the flags of the stream-ordered device collectives (src/comm/device/oneshot.rs).
//
// Every rank owns a workspace that its peers have mapped: two data slots and, per slot, a flag
// of two 64-bit words { call fingerprint, call sequence number }. A call is, on each rank's
// stream: copy the input into slot (seq % 2) -> `oneshot_signal` -> `oneshot_wait` -> ordinary
// kernels reading the peers' slots. No host thread waits, so a call costs launches, not a host
// round trip.
//
// Ordering: `oneshot_signal` runs after the copy into the slot finished (stream order) and
// publishes with a system-scope fence before the sequence word, so a peer that reads the
// sequence number reads the data after it. `oneshot_wait` reads the word with an acquire and ends
// before the kernels that read the data start. A signal never waits, and a rank signals call s
// before it waits in call s: no two ranks can wait for each other, whatever the block
// scheduling.
//
// Errors never hang and never pass silently: a wait gives up after `timeout_ns` (half the
// communicator's deadline) and records the first failure of this rank in its error record
// { code, peer, call, observed } (code 1: timed out, `observed` = the peer's last call, the
// later sequence number of its two flags; code 2: the peer is in a different collective,
// `observed` = its fingerprint); once a record is set, later waits return at once. The host
// reads the record at its next check (`GpuCommState::check`), where the ranks agree on it.
#include "compat.h"

// Flag words of slot `parity` in a flag area: [fingerprint, sequence].
#define MT_ONESHOT_FLAG_WORDS 2

extern "C" __global__ void oneshot_signal(mt_u64 *flags, int parity, mt_u64 seq, mt_u64 fingerprint) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    mt_u64 *flag = flags + MT_ONESHOT_FLAG_WORDS * parity;
    mt_store_volatile_u64(flag, fingerprint);
    mt_store_release_system_u64(flag + 1, seq);
}

// Thread p waits for peer p (peer_flags[p] is the address of peer p's flag area, 0 for this
// rank). `error` is this rank's 4-word error record.
extern "C" __global__ void oneshot_wait(const mt_u64 *peer_flags, int peers, int parity, mt_u64 seq,
                                        mt_u64 fingerprint, mt_u64 timeout_ns, mt_u64 *error) {
    const int p = threadIdx.x;
    if (blockIdx.x != 0 || p >= peers || peer_flags[p] == 0) return;
    if (mt_load_acquire_u64(error) != 0) return;
    const mt_u64 *flag = (const mt_u64 *)peer_flags[p] + MT_ONESHOT_FLAG_WORDS * parity;
    const mt_u64 *other_flag = (const mt_u64 *)peer_flags[p] + MT_ONESHOT_FLAG_WORDS * (1 - parity);
    const mt_u64 start = mt_timer_ns();
    mt_u64 seen = mt_load_acquire_u64(flag + 1);
    while (seen != seq) {
        if (mt_timer_ns() - start > timeout_ns || mt_load_acquire_u64(error) != 0) {
            // The peer's last call is the later of its two slots' sequence numbers.
            const mt_u64 other = mt_load_acquire_u64(other_flag + 1);
            if (atomicCAS(error, 0ull, 1ull) == 0ull) {
                mt_store_volatile_u64(error + 1, (mt_u64)p);
                mt_store_volatile_u64(error + 2, seq);
                mt_store_volatile_u64(error + 3, seen > other ? seen : other);
            }
            return;
        }
        mt_pause();
        seen = mt_load_acquire_u64(flag + 1);
    }
    const mt_u64 theirs = mt_load_volatile_u64(flag);
    if (theirs != fingerprint && atomicCAS(error, 0ull, 2ull) == 0ull) {
        mt_store_volatile_u64(error + 1, (mt_u64)p);
        mt_store_volatile_u64(error + 2, seq);
        mt_store_volatile_u64(error + 3, theirs);
    }
}
