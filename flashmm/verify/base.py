"""The result type every verifier returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    """Outcome of verifying one draft (a token tree) for a batch.

    path:         LongTensor [B, max_depth + 1]; node indices of the accepted path from the
                  root: path[b, 0] == 0 (the root), path[b, 1:accepted_len[b] + 1] the accepted
                  drafted nodes, -1 after that.
    accepted_len: LongTensor [B]; number of drafted tokens accepted (0 .. max_depth).
    next_token:   LongTensor [B]; the token emitted after the accepted path: the *bonus* token
                  (drawn from p at the last accepted node when it has no accepted child) or the
                  *recovered* token (drawn from the residual distribution after rejections).

    Emitted tokens for row b: tokens[b, path[b, 1:a+1]] followed by next_token[b].
    """

    path: torch.Tensor
    accepted_len: torch.Tensor
    next_token: torch.Tensor

    def emitted(self, tokens: torch.Tensor, b: int) -> list[int]:
        """Tokens emitted for row b (accepted drafted tokens, then next_token). tokens: [B, N]."""
        a = int(self.accepted_len[b])
        nodes = self.path[b, 1 : a + 1]
        return tokens[b, nodes].tolist() + [int(self.next_token[b])]
