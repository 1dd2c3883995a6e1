// The version control block of one generator replica: which slot of its weight buckets holds which
// policy version, who is reading it, and who is writing the next one. It lives in a small shared-memory
// segment (or private memory for a single process) and is driven with lock-free int64 atomics, so a
// trainer process and a generator process coordinate without any lock a crashed peer could leave held.
//
// Slots: the buckets hold `nslots` copies of the weights (1: pause at a batch boundary; 2: double
// buffering). Slot states:  FREE -> WRITING -> READY -> DRAINING -> WRITING -> READY ...
//   READY     a complete version; readers may acquire it.
//   DRAINING  a writer wants the slot: no new acquire of the newest version lands here, but a reader
//             asking for exactly this slot's version still may (TP peers joining their leader).
//   WRITING   the slot had no readers when the writer took it; nobody reads it until it is READY again.
// Invariant: a reader only ever holds a READY or DRAINING slot, and a writer only writes a WRITING slot,
// so a reader never observes a partially written version. The writer/reader handshake is a Dekker pair
// on seq_cst atomics: the reader bumps `readers` then checks `state`; the writer stores WRITING then
// checks `readers` (and steps back to DRAINING if it saw one); at least one of them sees the other.
//
// Writers: `n_writers` ranks (the trainer ranks) write parts of one version. Writer 0 (the leader)
// claims a slot for version v; the others wait for that claim; each calls finish when its copies are
// complete, and the last one publishes (slot READY, latest = slot). Claimed versions strictly increase,
// abandoned ones included: an abandoned version is never claimed again, so a claim_version value names one
// claim for ever, and an abandoner's compare-and-swap on it cannot free a later claim (no ABA).
// Waits are bounded: every wait takes a timeout and checks that the peers it waits for are alive, and
// throws SyncTimeout / PeerDied with a message that says who, what, and what to do.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace llamarl {

constexpr int kMaxSlots = 8;
constexpr int kMaxPeers = 64;

enum SlotState : int64_t { kSlotFree = 0, kSlotReady = 1, kSlotDraining = 2, kSlotWriting = 3 };

struct alignas(64) SlotCtl {
  std::atomic<int64_t> state;
  std::atomic<int64_t> version;
  std::atomic<int64_t> readers;
};

struct SyncCtl {
  std::atomic<uint64_t> magic;
  int64_t nslots;
  int64_t n_writers;
  int64_t n_readers;
  std::atomic<int64_t> latest_slot;     // newest READY slot, -1 before the first version
  std::atomic<int64_t> latest_version;  // its version, -1 before the first version
  std::atomic<int64_t> claim_version;   // version being written; -1: no write in flight, -2: being abandoned
  std::atomic<int64_t> claim_slot;
  std::atomic<int64_t> last_claimed;   // newest version ever claimed (published or abandoned), -1 before any
  std::atomic<int64_t> done;            // writers finished with claim_version
  std::atomic<int64_t> writer_pid[kMaxPeers];
  std::atomic<int64_t> writer_done[kMaxPeers];  // last version each writer finished
  std::atomic<int64_t> writer_gave_up[kMaxPeers];  // last version each writer gave up (will never finish)
  std::atomic<int64_t> reader_pid[kMaxPeers];
  SlotCtl slots[kMaxSlots];
};
static_assert(std::atomic<int64_t>::is_always_lock_free, "int64 atomics must be lock-free to share them");

class SyncTimeout : public std::runtime_error {
  using std::runtime_error::runtime_error;
};
class PeerDied : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

size_t ctl_nbytes();
SyncCtl* ctl_init(void* mem, size_t nbytes, int nslots, int n_writers, int n_readers);
SyncCtl* ctl_view(void* mem, size_t nbytes);  // checks the magic and sizes
void ctl_register(SyncCtl* c, bool writer, int rank, int64_t pid);  // pid 0 deregisters
// Readers. version < 0: the newest complete version (waits for a first one); else exactly `version`.
std::pair<int, int64_t> ctl_acquire(SyncCtl* c, int64_t version, double timeout_s);
void ctl_release(SyncCtl* c, int slot);
// Writers.
int ctl_claim(SyncCtl* c, int64_t version, double timeout_s);                   // writer 0
int ctl_wait_claim(SyncCtl* c, int writer, int64_t version, double timeout_s);  // writers 1..n-1
bool ctl_finish(SyncCtl* c, int writer, int slot, int64_t version);             // true: published
void ctl_wait_version(SyncCtl* c, int64_t version, double timeout_s);
// Drops the unfinished claim of `version` (any version if < 0; nothing if another one is claimed) once no
// live writer is still writing it (its slot becomes FREE, never READY):
// each writer has finished it, given it up or died. `writer` >= 0: that writer gives the claim up first (it
// will never finish it), so writers that all failed one version free it without waiting for each other;
// -1: a restarted trainer clearing what dead writers left (writers registered by this process are skipped).
// Throws std::runtime_error naming a writer that is alive and still writing.
void ctl_abandon(SyncCtl* c, int writer, int64_t version);

}  // namespace llamarl
