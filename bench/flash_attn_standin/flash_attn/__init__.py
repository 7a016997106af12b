"""A stand-in for the flash-attn package, for bench/megatron_engine_cycle.py alone: the two
functions Megatron-core's dynamic inference imports from it (megatron/core/transformer/
attention.py: flash_attn_varlen_func with a block table for prefill and mixed steps,
flash_attn_with_kvcache for decode steps), running the FlashAttention 3 kernels of vLLM's wheel
(vllm.vllm_flash_attn, in the folder scripts/vllm_engine_site.py makes). The GPU machine has no
flash-attn, PyPI has no binary of it, and Megatron's dynamic engine has no attention without it.
The version is the one Megatron asks for (2.7.3 or later) so that its FA2 path is taken; only the
arguments that path passes are accepted."""
import torch

__version__ = "2.7.4+vllmfa3"


def _kernel():
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def _window(window_size):
    return None if window_size is None or tuple(window_size) == (-1, -1) else list(window_size)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, block_table=None):
    if dropout_p or alibi_slopes is not None or softcap:
        raise NotImplementedError("flash_attn stand-in: dropout, ALiBi and softcap are not supported")
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=_window(window_size),
              return_softmax_lse=return_attn_probs, fa_version=3)
    if block_table is not None:  # paged keys: FA3 takes their lengths
        seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        out = _kernel()(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=seqused_k,
                        block_table=block_table, **kw)
    else:
        out = _kernel()(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k, **kw)
    if return_attn_probs:
        return out[0], out[1], None
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), block_table=None, num_splits=0, return_softmax_lse=False):
    if block_table is None or cache_seqlens is None or return_softmax_lse:
        raise NotImplementedError("flash_attn stand-in: only paged caches with their lengths, without the LSE")
    batch, seq, heads, dim = q.shape
    cu_q = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)
    max_k = block_table.shape[1] * k_cache.shape[1]
    out = _kernel()(q.reshape(batch * seq, heads, dim), k_cache, v_cache, seq, cu_q, max_k,
                    seqused_k=cache_seqlens.to(torch.int32), block_table=block_table, softmax_scale=softmax_scale,
                    causal=causal, window_size=_window(window_size), num_splits=num_splits, fa_version=3)
    return out.reshape(batch, seq, heads, -1)
