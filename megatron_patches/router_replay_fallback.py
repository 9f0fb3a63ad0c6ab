"""Router replay with a per-token fallback to the router's own top-k, and the own top-k recorded.

Upstream (megatron-core 0.16.1): `RouterReplay.get_replay_topk` (moe_enable_routing_replay) replays
the target ids of every token, or, with RECORD, records the router's own ids without replaying.
mrl replays routes that do not cover every token the trainer forwards: a sample's last token (the
engine never forwarded it), right padding, filler rows. Upstream has no way to say "this token:
route it yourself" (a placeholder id would silently send it to a wrong expert), and while replaying
it records nothing, so the trainer's own choice cannot be compared with the replayed one.

Patch: in REPLAY_FORWARD / REPLAY_BACKWARD a target row of negative ids (-1) takes the router's own
top-k for that token; with `record_own(replay, True)` the own top-k of every token is recorded
(get_recorded_indices) while the targets are replayed. Gate weights are still gathered from the
router's scores at the chosen ids (upstream's rule), so gradients reach the router. A target whose
row count differs from the router's tokens is an error, not a broadcast.

Drop when: upstream replays masked rows and records under replay (not up to 0.16.1).
"""

from __future__ import annotations

CPU_ONLY = False

_RECORD_OWN = "_mrl_record_own"  # instance flag set through record_own()


def record_own(replay, enabled: bool) -> None:
    """Record the router's own top-k while replaying (for routing-agreement metrics)."""
    setattr(replay, _RECORD_OWN, enabled)


def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """Upstream's signature and result; replayed rows of -1 use the router's own top-k (see the module)."""
    import torch

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    action = self.router_replay_action
    if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        return _upstream(self, scores, topk, num_groups, group_topk, default_compute_topk)
    if action == RouterReplayAction.REPLAY_FORWARD:
        target = self.target_topk_idx
    else:  # recomputation in backward: the forwards' targets, first in first out
        target = self.replay_backward_list.pop(0)
    if target is None:
        raise RuntimeError("router replay: no target ids were set for this router before its forward")
    target = target.to(device=scores.device, dtype=torch.long)
    if target.shape != (scores.shape[0], topk):
        raise RuntimeError(f"router replay: target ids of shape {tuple(target.shape)} for {scores.shape[0]} tokens "
                           f"and top-{topk}: the routes were sliced for another layout")
    missing = target[:, 0] < 0
    own = None
    if bool(missing.any()) or getattr(self, _RECORD_OWN, False):
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
        if getattr(self, _RECORD_OWN, False):
            self.record_indices(own)
    ids = torch.where(missing.unsqueeze(1), own, target) if own is not None else target
    return scores.gather(1, ids), ids


_upstream = None


def apply() -> None:
    global _upstream
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if RouterReplay.get_replay_topk is get_replay_topk:
        return
    _upstream = RouterReplay.get_replay_topk
    RouterReplay.get_replay_topk = get_replay_topk
