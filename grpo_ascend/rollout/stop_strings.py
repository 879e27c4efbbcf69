"""Stop strings for the built-in engine: host-side detection over the newest completion tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class StopStrings:
    """Host-side stop-string detection over the newest completion tokens of the running rows.

    At each check only a window of recent columns is decoded (long enough to contain any stop
    string), and the first column whose prefix text contains a stop string ends the row there:
    later tokens of that row are reset to pad / mask 0 / log-prob 0.
    """

    def __init__(self, tokenizer, stops: Sequence[str], pad: int) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.pad = pad
        # A string of c characters is at most 4c UTF-8 bytes, hence at most 4c byte-level tokens.
        self.window = 4 * max(len(s) for s in self.stops) + 2
        self.checked = 0  # columns before this one were already checked

    def _hit(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def check(
        self,
        t: int,
        row_map: Tensor,
        candidates: Tensor,
        done: Tensor,
        out_ids: Tensor,
        out_lp: Tensor,
        out_mask: Tensor,
    ) -> Tensor:
        """Scan columns up to ``t`` of the ``candidates`` rows (running at the previous check).

        Rows that ended by a stop token since then are scanned too: a stop string completed
        before that token ends them earlier. Returns the updated ``done``.
        """
        lo = max(0, self.checked - self.window)
        active = torch.nonzero(candidates).flatten()
        hits: list[tuple[int, int, int]] = []
        if active.numel():
            rows = row_map[active]
            block = out_ids[rows, lo : t + 1].tolist()
            for a, r, toks in zip(active.tolist(), rows.tolist(), block):
                if not self._hit(toks):
                    continue
                end = next(j for j in range(lo, t + 1) if self._hit(toks[: j - lo + 1]))
                hits.append((a, r, max(end, self.checked)))
        self.checked = t + 1
        if not hits:
            return done
        dev = done.device
        a_idx = torch.tensor([h[0] for h in hits], device=dev)
        r_idx = torch.tensor([h[1] for h in hits], device=dev)
        ends = torch.tensor([h[2] for h in hits], device=dev)
        after = torch.arange(out_ids.shape[1], device=dev).unsqueeze(0) > ends.unsqueeze(1)
        out_ids[r_idx] = out_ids[r_idx].masked_fill(after, self.pad)
        out_lp[r_idx] = out_lp[r_idx].masked_fill(after, 0.0)
        out_mask[r_idx] = out_mask[r_idx] & ~after
        done = done.clone()
        done[a_idx] = True
        return done
