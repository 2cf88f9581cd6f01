"""The heads that turn one block pass into drafts: the Markov chain and the confidence head.

Slot k (k = 0 .. nd-1) has the block pass's hidden h_k [d] and logits l_k (over the draft
vocabulary); x_{-1} is the anchor, x_k the slot's proposal (a target token id) and e_k = W1[x_{k-1}]
[r]. Slot k's chain logits, by the checkpoint's `markov` head:

* none:     l_k                                             (z-lab DFlash)
* vanilla:  l_k + W2 e_k                                    (DeepSpec VanillaMarkov; speculators)
* gated:    l_k + W2 (sigmoid(Wg [h_k ; e_k] + bg) * e_k)   (DeepSpec GatedMarkovHead)
* rnn:      [g ; c ; o] = Wj [s_{k-1} ; e_k ; h_k] + bj,  s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c),
            s_{-1} = 0;  l_k + W2 tanh(o)                   (DeepSpec RNNHead)
* selector: the top-K tokens C of l_k, scored l_k[C] + (P[x_{k-1}] * (H h_k)) . S[t(C)]; every other
            token -inf                                      (DFlash2's CandidateSelector)

W1, P and S index the target vocabulary; W2 and the logits cover the draft vocabulary, whose row j
is the target token t(j) = draft_to_target[j] (a d2t map holds j + d2t[j]). Greedy: x_k = the
argmax (lowest index on ties) of slot k's chain logits, mapped to its target id. Confidence:
c_k = sigmoid(w . h_k + b) ("hidden") or sigmoid(w . [h_k ; e_k] + b) ("markov"), with the e_k of
the chain's own x_{k-1}.
"""

from __future__ import annotations

import numpy as np

from ..ops import dense
from ..ops.argmax import argmax_rows
from ..ops.linear import linear


class Chain:
    """One round's chain over B sessions' draft slots. For k = 0, 1, ... in order: step(k), then
    choose(k, tokens) (or choose_greedy(k) for both); the rnn state and x_{k-1} carry over.

    Everything stays on the device: `drafts` [B, nd] int32 and `conf` [B, nd] f32 fill in as it
    goes, x_{k-1} is read from `drafts` by the next step's W1 gather, the draft-vocabulary map is
    a device gather, and each greedy argmax writes its NaN flags into `nan` [nd, B] unread. The
    caller reads them all back at once (DsparkDrafter.propose_greedy), so a chain of any layout
    costs the round no synchronisation of its own."""

    def __init__(self, drafter, hidden, logits, anchors):
        self.dr, self.be = drafter, drafter.be
        xp = self.be.xp
        self.c = drafter.config
        self.B, self.nd = len(anchors), self.c.drafts
        self.hidden, self.logits = hidden, logits  # [B*nd, .] session-major
        self.prev = xp.asarray(np.asarray(anchors, np.int32))
        self.drafts = xp.zeros((self.B, self.nd), np.int32)
        self.conf = xp.full((self.B, self.nd), np.nan, np.float32)
        self.nan = xp.zeros((self.nd, self.B), np.int32)
        r = self.c.markov_rank
        self.state = xp.zeros((self.B, r), np.float32) if self.c.markov == "rnn" else None

    def step(self, k: int):
        """Slot k's chain logits [B, draft vocab] given x_{k-1}; records its confidence."""
        xp, w, c = self.be.xp, self.dr.w, self.c
        rows = xp.asarray(np.arange(self.B) * self.nd + k)
        h, logits = self.hidden[rows], self.logits[rows]
        if c.markov == "vanilla":  # through the drafter's own bias (test drafters steer q there)
            bias, e = self.dr.markov_bias(self.prev)
            logits = logits + bias
        else:
            e = w["markov.w1"][self.prev] if c.markov_rank else None
        if c.markov == "gated":
            gate = dense.sigmoid(linear(self.be, xp.concatenate([h, e], axis=1), w["markov.gate_w"])
                                 + w["markov.gate_b"])
            logits = logits + linear(self.be, gate * e, w["markov.w2"])
        elif c.markov == "rnn":
            r = c.markov_rank
            z = linear(self.be, xp.concatenate([self.state, e, h], axis=1), w["markov.rnn_w"]) + w["markov.rnn_b"]
            gate = dense.sigmoid(z[:, :r])
            self.state = gate * self.state + (np.float32(1) - gate) * xp.tanh(z[:, r : 2 * r])
            logits = logits + linear(self.be, xp.tanh(z[:, 2 * r :]), w["markov.w2"])
        elif c.markov == "selector":
            logits = self._select(h, logits)
        if self.dr.has_confidence:
            self.conf[:, k] = self.dr.confidence(h, e)
        return logits

    def _select(self, h, logits):
        """DFlash2: only the unary top-K survive, rescored by the bilinear selector. The rank sum
        halves pairwise (halving_sum): an array library's sum over an axis may order a row's
        terms by the array's shape, which would tie a session's score to its batch."""
        xp, w, K = self.be.xp, self.dr.w, self.c.selector_top_k
        cand = xp.argsort(-logits, axis=1, kind="stable")[:, :K]   # ties: the lower index first
        ctx = w["selector.pred"][self.prev] * linear(self.be, h, w["selector.hidden"])   # [B, rank]
        succ = w["selector.succ"][cand if self.dr.d2t_dev is None else self.dr.d2t_dev[cand]]   # of target ids
        scores = xp.take_along_axis(logits, cand, axis=1) + dense.halving_sum(ctx[:, None, :] * succ)
        out = xp.full(logits.shape, -np.inf, np.float32)
        out[xp.arange(self.B)[:, None], cand] = scores
        return out

    def choose(self, k: int, tokens) -> None:
        """Fix slot k to target token ids tokens [B] (host or device; x_k, the next step's x_{k-1})."""
        xp = self.be.xp
        self.drafts[:, k] = tokens if isinstance(tokens, xp.ndarray) else xp.asarray(np.asarray(tokens, np.int32))
        self.prev = xp.ascontiguousarray(self.drafts[:, k])

    def choose_greedy(self, k: int) -> None:
        """x_k = the argmax of slot k's chain logits, as a target id; its NaN flags into nan[k]."""
        ids = argmax_rows(self.be, self.step(k), nan_flag=self.nan[k])
        self.choose(k, self.dr.d2t_dev[ids] if self.dr.d2t_dev is not None else ids)
