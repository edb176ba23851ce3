"""A stand-in for Transformer Engine's ``transformer_engine.pytorch``, laid out as TE v2.18 is.

It issues the collectives exactly as TE v2.18 (git tag ``v2.18``) does, on CPU tensors, so the
hooks of ``lagom_megatron.megatron.hooks.te_targets`` / ``patches`` can be tested without TE or a GPU:

* ``distributed.py``: ``gather_along_first_dim`` / ``reduce_scatter_along_first_dim`` /
  ``allreduce`` call ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
  ``all_reduce`` through the ``torch.distributed`` module with ``group=`` and ``async_op=`` as
  keywords and return ``(tensor, handle)`` (TE ``distributed.py:928-951,1640-1790,2013-2027``);
* ``module/linear.py`` / ``module/layernorm_linear.py``: module classes whose ``forward`` calls
  an autograd ``Function`` (``_Linear`` / ``_LayerNormLinear``) with the module's ``tp_group``;
  the column-parallel backward with sequence parallelism posts the input all-gather
  (``async_op=True``), computes dgrad, posts the dgrad reduce-scatter (``async_op=True``), waits
  the all-gather before the wgrad GEMM and the reduce-scatter at the end (TE ``linear.py:947-951,
  1064-1068``); the forward all-gather / reduce-scatter are synchronous (``linear.py:372,528``);
* ``attention/dot_product_attention``: ``DotProductAttention`` passes ``self.cp_group`` to an
  autograd function at forward (``dot_product_attention.py:1737``) that keeps it on ``ctx``
  (``context_parallel.py:2148``) and exchanges KV around the ring with
  ``flash_attn_p2p_communicate`` (``:96-135``), waiting each step's requests one step later
  (``:1702-1703``), in forward and backward; with ``cp_comm_type="a2a"`` an autograd function
  posts ``all_to_all_single(..., group=cp_group, async_op=True)`` per input and waits each after
  posting the next (``flash_attn_a2a_communicate``, ``:387-536``).

``tests/megatron/test_te_standin.py`` checks these names and calling patterns against the
installed Transformer Engine when one is importable.
"""
