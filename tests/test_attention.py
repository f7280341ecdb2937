"""paged_attention vs. dense scaled_dot_product_attention on scattered paged caches."""

import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from pagedkv.attention import paged_attention  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402

ATOL = RTOL = 1e-5


def _cdiv(a, b):
    return -(-a // b)


def scatter_to_paged(dense_k, dense_v, block_size, gen, *, extra_blocks=3, pad_value=0):
    """Scatter per-sequence dense K/V ``[ctx_i, H_kv, D]`` into a NaN-filled paged cache.

    Blocks are assigned from a random permutation; unused cache slots (including the
    tail of each last block) stay NaN so any read of padding poisons the result.
    Returns ``k_cache, v_cache, block_tables (int32, padded with pad_value)``.
    """
    num_kv_heads, head_dim = dense_k[0].shape[1:]
    needed = [_cdiv(k.shape[0], block_size) for k in dense_k]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    max_blocks = max(needed) + 1  # always at least one padding column
    tables = torch.full((len(dense_k), max_blocks), pad_value, dtype=torch.int32)
    for i, (k, v) in enumerate(zip(dense_k, dense_v)):
        for j in range(needed[i]):
            block = perm.pop()
            tables[i, j] = block
            rows = slice(j * block_size, min((j + 1) * block_size, k.shape[0]))
            n = rows.stop - rows.start
            k_cache[block, :n] = k[rows]
            v_cache[block, :n] = v[rows]
    return k_cache, v_cache, tables


def reference_attention(q, k, v, scale):
    """Dense causal reference for one sequence.

    ``q [q_len, H, D]`` are the last ``q_len`` positions of a ``ctx``-token sequence
    whose K/V are ``[ctx, H_kv, D]``.
    """
    group = q.shape[1] // k.shape[1]
    ctx, q_len = k.shape[0], q.shape[0]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(ctx - q_len, ctx)
    mask = torch.arange(ctx)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def random_case(gen, *, num_kv_heads, group, head_dim, block_size, ctx_lens, q_lens):
    """Random dense Q/K/V for a batch; returns everything a comparison needs."""
    num_heads = num_kv_heads * group
    dense_k = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in ctx_lens]
    dense_v = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for c in ctx_lens]
    queries = [torch.randn(n, num_heads, head_dim, generator=gen) for n in q_lens]
    k_cache, v_cache, tables = scatter_to_paged(dense_k, dense_v, block_size, gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "dense_k": dense_k,
        "dense_v": dense_v,
        "queries": queries,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "ctx": torch.tensor(ctx_lens, dtype=torch.int32),
        "qsl": qsl,
    }


def expected_output(case, scale):
    outs = [
        reference_attention(q, k, v, scale)
        for q, k, v in zip(case["queries"], case["dense_k"], case["dense_v"])
    ]
    return torch.cat(outs)


def sample_lengths(gen, block_size, mode, num_seqs):
    """Ragged context lengths (with 1, exact block multiples, +1) and query lengths."""
    special = [1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1]
    ctx = [special[i] if i < len(special) else 0 for i in range(num_seqs)]
    for i in range(len(special), num_seqs):
        ctx[i] = int(torch.randint(1, 5 * block_size, (1,), generator=gen))
    if mode == "decode":
        q = [1] * num_seqs
    elif mode == "prefill":  # chunked prefill: random chunk of the tail, incl. full prompt
        q = [int(torch.randint(1, c + 1, (1,), generator=gen)) for c in ctx]
        q[-1] = ctx[-1]
    else:  # mixed: alternate decode tokens and prefill chunks
        q = [int(torch.randint(1, c + 1, (1,), generator=gen)) for c in ctx]
        q[1::2] = [1] * len(q[1::2])
    return ctx, q


@pytest.mark.parametrize("mode", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_sdpa(mode, block_size, group):
    gen = torch.Generator().manual_seed(1000 * group + 10 * block_size + len(mode))
    for trial in range(3):
        num_seqs = 5 + trial * 2
        num_kv_heads = 1 + trial % 2
        head_dim = (16, 32, 8)[trial]
        ctx, q_lens = sample_lengths(gen, block_size, mode, num_seqs)
        case = random_case(
            gen,
            num_kv_heads=num_kv_heads,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            ctx_lens=ctx,
            q_lens=q_lens,
        )
        query = torch.cat(case["queries"])
        qsl = None if mode == "decode" else case["qsl"]
        out = paged_attention(
            query,
            case["k_cache"],
            case["v_cache"],
            case["tables"],
            case["ctx"],
            query_start_loc=qsl,
            backend="torch",
        )
        expected = expected_output(case, 1.0 / math.sqrt(head_dim))
        assert out.shape == query.shape and out.dtype == query.dtype
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def _small_case(seed=0, q_lens=(1, 3, 2), ctx_lens=(5, 9, 16), block_size=4, group=2):
    gen = torch.Generator().manual_seed(seed)
    return random_case(
        gen,
        num_kv_heads=2,
        group=group,
        head_dim=8,
        block_size=block_size,
        ctx_lens=list(ctx_lens),
        q_lens=list(q_lens),
    )


def _run(case, **kwargs):
    kwargs.setdefault("query_start_loc", case["qsl"])
    kwargs.setdefault("backend", "torch")
    return paged_attention(
        torch.cat(case["queries"]),
        case["k_cache"],
        case["v_cache"],
        case["tables"],
        case["ctx"],
        **kwargs,
    )


@pytest.mark.parametrize("pad_value", [0, -1, 10**6])
def test_block_table_padding_is_ignored(pad_value):
    case = _small_case()
    reference = _run(case)
    tables = case["tables"].clone()
    used = torch.arange(tables.shape[1])[None, :] < (-(-case["ctx"] // 4))[:, None]
    tables[~used] = pad_value
    out = paged_attention(
        torch.cat(case["queries"]),
        case["k_cache"],
        case["v_cache"],
        tables,
        case["ctx"],
        query_start_loc=case["qsl"],
        backend="torch",
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, atol=0, rtol=0)


def test_custom_scale_int64_metadata_and_no_validation():
    case = _small_case(seed=3)
    scale = 0.37
    out = paged_attention(
        torch.cat(case["queries"]),
        case["k_cache"],
        case["v_cache"],
        case["tables"].long(),
        case["ctx"].long(),
        query_start_loc=case["qsl"].long(),
        scale=scale,
        backend="auto",  # CPU -> torch path
        validate=False,
    )
    torch.testing.assert_close(out, expected_output(case, scale), atol=ATOL, rtol=RTOL)


def test_zero_length_query_sequence_is_skipped():
    case = _small_case(seed=4, q_lens=(2, 0, 3), ctx_lens=(7, 6, 3))
    out = _run(case)
    expected = expected_output(case, 1.0 / math.sqrt(8))
    assert out.shape[0] == 5
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_low_precision_accumulates_in_fp32():
    case = _small_case(seed=5)
    query = torch.cat(case["queries"]).bfloat16()
    k_cache = case["k_cache"].bfloat16()
    v_cache = case["v_cache"].bfloat16()
    out = paged_attention(
        query, k_cache, v_cache, case["tables"], case["ctx"], query_start_loc=case["qsl"]
    )
    assert out.dtype == torch.bfloat16
    expected = expected_output(case, 1.0 / math.sqrt(8))
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)


def test_empty_batch():
    k_cache = torch.zeros(2, 4, 1, 8)
    out = paged_attention(
        torch.zeros(0, 2, 8),
        k_cache,
        k_cache,
        torch.zeros(0, 3, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
        (lambda a: a.update(query=a["query"][..., :4]), "query must be"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :2]), "k_cache and v_cache"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables"),
        (lambda a: a.update(block_tables=a["block_tables"][:, :2]), "capacity"),
        (lambda a: a.update(context_lens=a["context_lens"][:2]), "context_lens"),
        (lambda a: a.update(context_lens=torch.tensor([5, 2, 16])), "query lengths"),
        (lambda a: a.update(query_start_loc=torch.tensor([0, 1, 4, 5])), "query_start_loc"),
        (lambda a: a.update(query_start_loc=torch.tensor([0, 3, 2, 6])), "query_start_loc"),
        (lambda a: a.update(query_start_loc=None), "decode"),
        (lambda a: a["block_tables"].__setitem__((1, 0), 99), "outside"),
        (lambda a: a["block_tables"].__setitem__((2, 3), -1), "outside"),
        (lambda a: a.update(backend="triton"), "backend"),
    ],
)
def test_bad_arguments_raise(change, match):
    case = _small_case()
    args = {
        "query": torch.cat(case["queries"]),
        "k_cache": case["k_cache"],
        "v_cache": case["v_cache"],
        "block_tables": case["tables"].clone(),
        "context_lens": case["ctx"],
        "query_start_loc": case["qsl"],
        "backend": "torch",
    }
    change(args)
    with pytest.raises(InvalidArgumentError, match=match):
        paged_attention(**args)


def test_forcing_flash_backend_on_cpu_raises():
    case = _small_case()
    with pytest.raises(ValueError, match="not on CUDA"):
        _run(case, backend="flash_attn")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_torch_backend_on_cuda_matches_cpu():
    case = _small_case(seed=6, block_size=16, ctx_lens=(40, 17, 16), q_lens=(1, 17, 5))
    cpu = _run(case)
    gpu = paged_attention(
        torch.cat(case["queries"]).cuda(),
        case["k_cache"].cuda(),
        case["v_cache"].cuda(),
        case["tables"].cuda(),
        case["ctx"].cuda(),
        query_start_loc=case["qsl"].cuda(),
        backend="torch",
    )
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_flash_attn_backend_matches_torch(mode):
    pytest.importorskip("flash_attn")
    gen = torch.Generator().manual_seed(7)
    ctx, q_lens = sample_lengths(gen, 256, mode, 6)
    case = random_case(
        gen, num_kv_heads=2, group=4, head_dim=64, block_size=256, ctx_lens=ctx, q_lens=q_lens
    )
    # flash reads whole blocks; NaN in unused tails would be masked but keep inputs finite
    k_cache = torch.nan_to_num(case["k_cache"]).cuda().half()
    v_cache = torch.nan_to_num(case["v_cache"]).cuda().half()
    args = (
        torch.cat(case["queries"]).cuda().half(),
        k_cache,
        v_cache,
        case["tables"].cuda(),
        case["ctx"].cuda(),
    )
    qsl = None if mode == "decode" else case["qsl"].cuda()
    flash = paged_attention(*args, query_start_loc=qsl, backend="flash_attn")
    ref = paged_attention(*args, query_start_loc=qsl, backend="torch")
    torch.testing.assert_close(flash.float(), ref.float(), atol=2e-3, rtol=2e-3)
