"""A transformer on a long sequence sharded over the ranks: ring attention.

Run with any number of ranks, e.g. ``mpiexec -n 2 python examples/transformer.py``
(add ``--causal`` for causal attention; ``--help`` lists the options).

The sequence (batch, tokens, features) is cut along the tokens, so each rank
holds T / P of them. The model is plain PyTorch: a linear embedding, learned
positional embeddings (a parameter, cut to each rank's tokens by domainpar),
pre-norm blocks of multi-head attention written with
``F.scaled_dot_product_attention`` and an MLP. On the sharded sequence the
attention runs as a ring: the key/value blocks travel around the ranks while
each rank computes on the one it holds, so no rank ever holds the whole
sequence's keys or the T x T scores. LayerNorm and the linear layers act on
each token and need no communication.

The task: each sequence is a signal (one random value per feature) plus
noise on every token, and the target at token t is the mean of the tokens the
attention may see there (all of them, or with ``--causal`` those up to t),
the best estimate of the signal; it needs every rank's tokens. The target is
made from the sharded input itself, by attention with equal scores, which is
that mean.

At the end the trained model on one batch, sharded, is checked against one
process running it on the whole sequence (output and gradients, in float64).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import TrainingLog, add_training_options, check_against_one_process, refuse, show_blocks

import domainpar as dp

SHARD = {1: 0}  # the token dim along grid axis 0


# -- the model: plain PyTorch ----------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head self-attention: separate q, k, v projections, heads split off
    the feature dim, F.scaled_dot_product_attention (causal or not)."""

    def __init__(self, dim, heads, causal):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.v, self.out = (nn.Linear(dim, dim) for _ in range(3))
        # No bias on the keys: it would add the same to all of a query's scores,
        # which softmax takes out again (its gradient is zero).
        self.k = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape

        def split(h):  # (B, T, D) -> (B, heads, T, D / heads)
            return h.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                           is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SequenceModel(nn.Module):
    def __init__(self, features, length, dim=32, heads=4, depth=2, causal=False):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, length, dim))
        self.attn = nn.ModuleList(Attention(dim, heads, causal) for _ in range(depth))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                               nn.Linear(2 * dim, dim)) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * depth + 1))
        self.head = nn.Linear(dim, features)

    def forward(self, x):
        h = self.embed(x) + self.pos
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            h = h + attn(self.norms[2 * i](h))
            h = h + mlp(self.norms[2 * i + 1](h))
        return self.head(self.norms[-1](h))


def batch(step, args, grid):
    """Collective. A batch drawn on rank 0 and scattered along the tokens, and its
    target (a DomainTensor cut the same way)."""
    x = None
    if grid.comm.rank == 0:
        g = torch.Generator().manual_seed(args.seed * 100003 + step)
        signal = torch.randn(args.batch, 1, args.features, generator=g)
        x = signal + torch.randn(args.batch, args.length, args.features, generator=g)
    x = dp.scatter(x, grid, shard=SHARD)
    # Equal scores (zero queries and keys) weigh every visible token alike: the mean.
    zeros = torch.zeros_like(x)
    return x, F.scaled_dot_product_attention(zeros, zeros, x, is_causal=args.causal)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048,
                        help="tokens in a sequence (default %(default)s)")
    parser.add_argument("--batch", type=int, default=2,
                        help="sequences a step (default %(default)s)")
    parser.add_argument("--features", type=int, default=4,
                        help="features of a token (default %(default)s)")
    parser.add_argument("--dim", type=int, default=32, help="model width (default %(default)s)")
    parser.add_argument("--heads", type=int, default=4,
                        help="attention heads (default %(default)s)")
    parser.add_argument("--depth", type=int, default=2,
                        help="transformer blocks (default %(default)s)")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    add_training_options(parser, steps=20, lr=3e-3)
    args = parser.parse_args()

    comm = dp.init()
    if min(args.steps, args.length, args.batch, args.features) < 1:
        refuse(comm, "--steps, --length, --batch and --features must be positive")
    if args.dim % args.heads:
        refuse(comm, f"--dim {args.dim} does not split into {args.heads} heads")
    grid = dp.ProcessGrid(dims=(comm.size,))

    torch.manual_seed(args.seed)
    net = SequenceModel(args.features, args.length, args.dim, args.heads, args.depth, args.causal)
    model = dp.DomainParallel(net, grid)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    x, _ = batch(0, args, grid)
    if comm.rank == 0:
        print(f"sequence {tuple(x.shape)} (batch, tokens, features), "
              f"{'causal' if args.causal else 'full'} attention")
    show_blocks(comm, x, {1: "tokens"})

    log = TrainingLog(comm, args.steps)  # the progress line and the final loss
    for step in log:
        x, target = batch(step, args, grid)
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        log.record(loss)
    if not args.no_check:
        sample = x.full_tensor()  # gathered for the check only
        check_against_one_process(comm, net, sample, grid, SHARD)


if __name__ == "__main__":
    main()
