// Version control block: slot claims, publication and reader holds on shared atomics (see sync_ctl.h).
#include "sync_ctl.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <new>
#include <thread>

#include <unistd.h>

#include "shm.h"

namespace llamarl {

namespace {

constexpr uint64_t kMagic = 0x334c52414d414c4cULL;  // "LLAMARL3"
constexpr int64_t kNoClaim = -1;     // claim_version when no write is in flight
constexpr int64_t kAbandoning = -2;  // while an abandoned claim's slot is being freed
using Clock = std::chrono::steady_clock;

std::string state_name(int64_t s) {
  switch (s) {
    case kSlotFree: return "FREE";
    case kSlotReady: return "READY";
    case kSlotDraining: return "DRAINING";
    case kSlotWriting: return "WRITING";
    default: return "?" + std::to_string(s);
  }
}

std::string describe(const SyncCtl* c) {
  std::string s = "latest version " + std::to_string(c->latest_version.load()) + " in slot " +
                  std::to_string(c->latest_slot.load()) + ", claim " + std::to_string(c->claim_version.load()) +
                  " (slot " + std::to_string(c->claim_slot.load()) + ", " + std::to_string(c->done.load()) + "/" +
                  std::to_string(c->n_writers) + " writers done); slots:";
  for (int i = 0; i < c->nslots; ++i)
    s += " [" + std::to_string(i) + ": " + state_name(c->slots[i].state.load()) + " v" +
         std::to_string(c->slots[i].version.load()) + ", " + std::to_string(c->slots[i].readers.load()) +
         " readers]";
  return s;
}

// Throws PeerDied if a registered peer of the given role has exited.
void check_alive(const SyncCtl* c, bool writers, const std::string& context, int only = -1) {
  const int n = static_cast<int>(writers ? c->n_writers : c->n_readers);
  for (int k = 0; k < n; ++k) {
    if (only >= 0 && k != only) continue;
    const int64_t pid = (writers ? c->writer_pid : c->reader_pid)[k].load();
    if (pid != 0 && !pid_alive(pid))
      throw PeerDied(std::string(writers ? "writer" : "reader") + " rank " + std::to_string(k) + " (pid " +
                     std::to_string(pid) + ") has exited " + context + " [" + describe(c) + "]");
  }
}

// Polls `ready` until it holds; spins briefly, then sleeps 20 us growing to 1 ms. Every ~50 ms runs
// `check` (which throws PeerDied); at the deadline throws SyncTimeout with `what()`.
void wait_until(const std::function<bool()>& ready, double timeout_s, const std::function<void()>& check,
                const std::function<std::string()>& what) {
  if (std::isnan(timeout_s)) throw std::invalid_argument("timeout must be a number of seconds, got nan");
  if (ready()) return;
  const auto start = Clock::now();
  const bool forever = timeout_s > 1e9;  // inf, or past what a duration in nanoseconds holds (~292 years)
  const auto deadline = forever ? Clock::time_point::max()
                                : start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(std::max(timeout_s, 0.0)));
  auto last_check = start;
  std::chrono::microseconds nap(20);
  for (int spin = 0;; ++spin) {
    if (ready()) return;
    const auto now = Clock::now();
    if (now - last_check > std::chrono::milliseconds(50)) {
      check();
      last_check = now;
    }
    if (now >= deadline) {
      check();
      throw SyncTimeout(what());
    }
    if (spin < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }
}

std::string secs(double t) { return std::to_string(t) + " s"; }

void check_slot(const SyncCtl* c, int slot) {
  if (slot < 0 || slot >= c->nslots)
    throw std::invalid_argument("slot " + std::to_string(slot) + " is not in [0, " + std::to_string(c->nslots) + ")");
}

}  // namespace

size_t ctl_nbytes() { return sizeof(SyncCtl); }

SyncCtl* ctl_init(void* mem, size_t nbytes, int nslots, int n_writers, int n_readers) {
  if (nbytes < sizeof(SyncCtl))
    throw std::invalid_argument("control block needs " + std::to_string(sizeof(SyncCtl)) + " bytes, got " +
                                std::to_string(nbytes));
  if (reinterpret_cast<uintptr_t>(mem) % alignof(SyncCtl) != 0)
    throw std::invalid_argument("control block memory must be " + std::to_string(alignof(SyncCtl)) + "-byte aligned");
  if (nslots < 1 || nslots > kMaxSlots)
    throw std::invalid_argument("nslots must be in [1, " + std::to_string(kMaxSlots) + "], got " + std::to_string(nslots));
  if (n_writers < 1 || n_writers > kMaxPeers || n_readers < 1 || n_readers > kMaxPeers)
    throw std::invalid_argument("n_writers and n_readers must be in [1, " + std::to_string(kMaxPeers) + "], got " +
                                std::to_string(n_writers) + " and " + std::to_string(n_readers));
  SyncCtl* c = new (mem) SyncCtl;
  c->nslots = nslots;
  c->n_writers = n_writers;
  c->n_readers = n_readers;
  c->latest_slot.store(-1);
  c->latest_version.store(-1);
  c->claim_version.store(-1);
  c->claim_slot.store(-1);
  c->last_claimed.store(-1);
  c->done.store(0);
  for (int k = 0; k < kMaxPeers; ++k) {
    c->writer_pid[k].store(0);
    c->writer_done[k].store(-1);
    c->writer_gave_up[k].store(-1);
    c->reader_pid[k].store(0);
  }
  for (int s = 0; s < kMaxSlots; ++s) {
    c->slots[s].state.store(kSlotFree);
    c->slots[s].version.store(-1);
    c->slots[s].readers.store(0);
  }
  c->magic.store(kMagic);  // last: an attacher that sees the magic sees an initialised block
  return c;
}

SyncCtl* ctl_view(void* mem, size_t nbytes) {
  if (nbytes < sizeof(SyncCtl))
    throw std::invalid_argument("control block needs " + std::to_string(sizeof(SyncCtl)) + " bytes, got " +
                                std::to_string(nbytes));
  auto* c = static_cast<SyncCtl*>(mem);
  if (c->magic.load() != kMagic)
    throw std::runtime_error("memory is not an initialised llamarl sync control block (bad magic): the handle "
                             "is stale or from another llamarl version");
  // the header is shared with other processes: never index with a field that is out of range
  const int64_t slots = c->nslots, writers = c->n_writers, readers = c->n_readers;
  const int64_t latest = c->latest_slot.load(), claimed = c->claim_slot.load();
  if (slots < 1 || slots > kMaxSlots || writers < 1 || writers > kMaxPeers || readers < 1 || readers > kMaxPeers ||
      latest < -1 || latest >= slots || claimed < -1 || claimed >= slots)
    throw std::runtime_error("sync control block is corrupt (nslots " + std::to_string(slots) + ", writers " +
                             std::to_string(writers) + ", readers " + std::to_string(readers) + ", latest slot " +
                             std::to_string(latest) + ", claimed slot " + std::to_string(claimed) +
                             "): recreate the generator's buckets");
  return c;
}

void ctl_register(SyncCtl* c, bool writer, int rank, int64_t pid) {
  const int64_t n = writer ? c->n_writers : c->n_readers;
  if (rank < 0 || rank >= n)
    throw std::invalid_argument(std::string(writer ? "writer" : "reader") + " rank " + std::to_string(rank) +
                                " is not in [0, " + std::to_string(n) + ")");
  (writer ? c->writer_pid : c->reader_pid)[rank].store(pid);
}

std::pair<int, int64_t> ctl_acquire(SyncCtl* c, int64_t version, double timeout_s) {
  int got_slot = -1;
  int64_t got_version = -1;
  auto try_once = [&]() -> bool {
    int s = -1;
    if (version < 0) {
      s = static_cast<int>(c->latest_slot.load());
      if (s < 0) return false;
    } else {
      // A slot still labelled `version` holds its bytes, whatever its state: a writer draining it flips the
      // state to WRITING and back while it waits for the readers (ctl_claim), and relabels the slot only
      // once the claim succeeds. So "no longer held" is decided from the labels alone; a labelled slot
      // seen mid-flip is retried (a TP peer joining its leader, whose hold keeps the slot from the writer).
      bool labelled = false;
      for (int i = 0; i < c->nslots; ++i) {
        const int64_t st = c->slots[i].state.load();
        if (c->slots[i].version.load() != version) continue;
        labelled = true;
        if (st == kSlotReady || st == kSlotDraining) {
          s = i;
          break;
        }
      }
      if (s < 0) {
        if (!labelled && c->latest_version.load() > version && c->claim_version.load() != version)
          throw std::runtime_error("version " + std::to_string(version) +
                                   " is no longer held by any slot (newest is " +
                                   std::to_string(c->latest_version.load()) +
                                   "): acquire the newest version instead [" + describe(c) + "]");
        return false;
      }
    }
    SlotCtl& sl = c->slots[s];
    sl.readers.fetch_add(1);
    const int64_t st = sl.state.load();
    const int64_t v = sl.version.load();
    const bool ok = version < 0 ? st == kSlotReady : ((st == kSlotReady || st == kSlotDraining) && v == version);
    if (ok) {
      got_slot = s;
      got_version = v;
      return true;
    }
    sl.readers.fetch_sub(1);
    return false;
  };
  wait_until(
      try_once, timeout_s,
      [&] { check_alive(c, /*writers=*/true, "while this reader waits for a complete weight version"); },
      [&] {
        return std::string("no complete weight version") +
               (version >= 0 ? " " + std::to_string(version) : std::string()) + " could be acquired within " +
               secs(timeout_s) + ": the trainer has not synced yet, or a sync is still draining/writing [" +
               describe(c) + "]";
      });
  return {got_slot, got_version};
}

void ctl_release(SyncCtl* c, int slot) {
  check_slot(c, slot);
  const int64_t before = c->slots[slot].readers.fetch_sub(1);
  if (before <= 0) {
    c->slots[slot].readers.fetch_add(1);
    throw std::runtime_error("release of slot " + std::to_string(slot) + " that this reader does not hold");
  }
}

int ctl_claim(SyncCtl* c, int64_t version, double timeout_s) {
  if (version < 0) throw std::invalid_argument("policy versions must be >= 0, got " + std::to_string(version));
  // A previous version must be complete before the next one starts.
  wait_until(
      [&] { return c->claim_version.load() == kNoClaim; }, timeout_s,  // (not while one is being abandoned)
      [&] { check_alive(c, true, "in the middle of writing version " + std::to_string(c->claim_version.load()) +
                                     "; its slot stays unpublished. Restart the trainer and call abandon() first"); },
      [&] { return "the previous sync did not finish within " + secs(timeout_s) + " [" + describe(c) + "]"; });
  if (version <= c->latest_version.load())
    throw std::invalid_argument("policy version " + std::to_string(version) + " is not newer than the published " +
                                std::to_string(c->latest_version.load()) + ": versions must strictly increase");
  if (version <= c->last_claimed.load())  // (only this writer stores it)
    throw std::invalid_argument("policy version " + std::to_string(version) + " is not newer than version " +
                                std::to_string(c->last_claimed.load()) + ", claimed and abandoned before: an "
                                "abandoned version is never written again; sync the next one");
  // Pick the slot: with one slot, the only one; else a non-latest slot, preferring free ones, then the
  // oldest version.
  const int latest = static_cast<int>(c->latest_slot.load());
  int s = 0;
  if (c->nslots > 1) {
    int best = -1;
    for (int i = 0; i < c->nslots; ++i) {
      if (i == latest) continue;
      const bool idle = c->slots[i].readers.load() == 0;
      if (best < 0) { best = i; continue; }
      const bool best_idle = c->slots[best].readers.load() == 0;
      if ((idle && !best_idle) ||
          (idle == best_idle && c->slots[i].version.load() < c->slots[best].version.load()))
        best = i;
    }
    s = best;
  }
  SlotCtl& sl = c->slots[s];
  const int64_t before = sl.state.load();  // only writer 0 ever changes a slot's state
  sl.state.store(kSlotDraining);
  // Dekker: store WRITING, then look for readers; a reader bumps `readers`, then looks at `state`.
  try {
    wait_until(
        [&] {
          sl.state.store(kSlotWriting);
          if (sl.readers.load() == 0) return true;
          sl.state.store(kSlotDraining);
          return false;
        },
        timeout_s,
        [&] { check_alive(c, false, "while holding the weight slot the trainer needs for version " +
                                         std::to_string(version)); },
        [&] {
          return "slot " + std::to_string(s) + " still has readers after " + secs(timeout_s) +
                 ": the generator must release() at batch boundaries (or use 2 slots) [" + describe(c) + "]";
        });
  } catch (...) {
    sl.state.store(before);  // give the slot back to its readers untouched
    throw;
  }
  sl.version.store(-1);
  c->claim_slot.store(s);
  c->done.store(0);
  c->last_claimed.store(version);
  c->claim_version.store(version);  // last: followers read claim_slot after seeing this
  return s;
}

int ctl_wait_claim(SyncCtl* c, int writer, int64_t version, double timeout_s) {
  if (writer < 1 || writer >= c->n_writers)
    throw std::invalid_argument("ctl_wait_claim is for writers 1.." + std::to_string(c->n_writers - 1) +
                                ", got writer " + std::to_string(writer));
  wait_until(
      [&] {
        const int64_t cv = c->claim_version.load();
        if (cv > version || (cv < 0 && c->latest_version.load() >= version))
          throw std::runtime_error("writer " + std::to_string(writer) + " syncs version " + std::to_string(version) +
                                   " but the leader (writer 0) already moved past it: every trainer rank must call "
                                   "sync with the same versions, in order [" + describe(c) + "]");
        return cv == version;
      },
      timeout_s,
      [&] {
        check_alive(c, true, "before claiming a slot for version " + std::to_string(version), 0);
        check_alive(c, false, "while holding the slot writer 0 waits for");
      },
      [&] {
        return "writer 0 did not claim a slot for version " + std::to_string(version) + " within " + secs(timeout_s) +
               " (is trainer rank 0 calling sync with the same version?) [" + describe(c) + "]";
      });
  return static_cast<int>(c->claim_slot.load());
}

bool ctl_finish(SyncCtl* c, int writer, int slot, int64_t version) {
  if (writer < 0 || writer >= c->n_writers)
    throw std::invalid_argument("writer " + std::to_string(writer) + " is not in [0, " + std::to_string(c->n_writers) + ")");
  check_slot(c, slot);
  if (c->claim_version.load() != version || c->claim_slot.load() != slot)
    throw std::runtime_error("finish(slot " + std::to_string(slot) + ", version " + std::to_string(version) +
                             ") does not match the current claim [" + describe(c) + "]");
  // one finish per writer and version: a repeated one must not stand in for a writer that has not written
  if (c->writer_done[writer].exchange(version) == version)
    throw std::runtime_error("writer " + std::to_string(writer) + " already finished version " +
                             std::to_string(version) + " [" + describe(c) + "]");
  if (c->done.fetch_add(1) + 1 < c->n_writers) return false;
  SlotCtl& sl = c->slots[slot];
  sl.version.store(version);
  sl.state.store(kSlotReady);
  c->latest_slot.store(slot);
  c->latest_version.store(version);
  c->claim_version.store(-1);
  return true;
}

void ctl_wait_version(SyncCtl* c, int64_t version, double timeout_s) {
  wait_until(
      [&] { return c->latest_version.load() >= version; }, timeout_s,
      [&] { check_alive(c, true, "before version " + std::to_string(version) + " was complete"); },
      [&] {
        return "version " + std::to_string(version) + " was not published within " + secs(timeout_s) + " [" +
               describe(c) + "]";
      });
}

void ctl_abandon(SyncCtl* c, int writer, int64_t version) {
  if (writer < -1 || writer >= c->n_writers)
    throw std::invalid_argument("writer " + std::to_string(writer) + " is not in [-1, " + std::to_string(c->n_writers) +
                                ")");
  int64_t cv = c->claim_version.load();
  if (cv < 0 || (version >= 0 && cv != version)) return;  // no claim, one being abandoned, or another version
  // Dekker, as in claim: mark this writer's give-up, then look at the others' marks; of two writers giving
  // up at once, at least one sees the other's, so a version every writer failed is always freed.
  if (writer >= 0) c->writer_gave_up[writer].store(cv);
  const int64_t self = static_cast<int64_t>(getpid());
  for (int k = 0; k < c->n_writers; ++k) {
    const int64_t pid = c->writer_pid[k].load();
    if (k == writer || pid == 0 || (writer < 0 && pid == self) || !pid_alive(pid)) continue;
    if (c->writer_done[k].load() != cv && c->writer_gave_up[k].load() != cv)
      throw std::runtime_error("cannot abandon version " + std::to_string(cv) + ": writer rank " + std::to_string(k) +
                               " (pid " + std::to_string(pid) + ") is alive and still writing it");
  }
  // One abandoner resets the claim: two writers giving up at once may both pass the checks above, and the
  // slot must be freed before the leader can claim again (it waits for kNoClaim, not kAbandoning). A claim
  // published meanwhile (every writer finished) is left alone; cv cannot name a later claim (claimed versions
  // strictly increase), so the swap frees exactly the claim checked above.
  if (!c->claim_version.compare_exchange_strong(cv, kAbandoning)) return;
  const int s = static_cast<int>(c->claim_slot.load());
  if (s >= 0) {
    c->slots[s].version.store(-1);
    c->slots[s].state.store(kSlotFree);
  }
  c->claim_version.store(kNoClaim);  // the writers' marks of cv stay: cv is never claimed again
}

}  // namespace llamarl
