"""The catalog: every fault tpdp-verify has found in torch, as records (tpdp_verify.faults).

docs/known-divergences.md is generated from it (``tpdp-verify explain --all``); a test keeps
the two alike. A record's ``shows`` are the rules by which it explains a failure's parts;
each says why it holds where it does.
"""

from tpdp_verify.faults.record import Fault, Shows

DDP = ("transform_ddp", "ddp_mesh", "replicate")  # the entry points that run torch's DDP transform

CATALOG = (
Fault(
    number=1,
    name='DDP transform unregisters TP parameters',
    title='After a forward, the DDP transform leaves no TP parameter registered',
    what="""`_pre_dp_module_transform` swaps each DTensor parameter for its local shard. Its forward
pre-hook then puts DTensors back *outside* the module's registry, so after the first
forward `named_parameters()`, `parameters()` and `state_dict()` hold none of the TP
weights.

- **Caught by:**
  - `registry_preserved` (`ParameterNames`, `StateDictNamesAndGlobalShapes`, `RequiresGrad`)
  - `trains_like_one_device`, `trains_like_plain_ddp` and `entry_points_train_like_one_device` (`ParametersStayRegisteredInOrder`)
  - `state_dict_like_unsharded`, `checkpoint_resumes`, `entry_points_state_dict_like_unsharded` (missing keys; `model state_dict is empty`)""",
    consequence="""- An optimizer built after the first forward trains only the non-TP parameters.
  - `state_dict()`, `get_model_state_dict` and DCP checkpoints lose every TP weight, and loading them raises `Missing key(s)`.
  - Right after wrapping, `state_dict()` holds local shards rather than the global tensors.
  - `tpdp-verify plan` shows the same fault on the user guide's Llama block.""",
    workaround="""- Build the optimizer right after wrapping, before any forward.
  - Keep the parameter handles you captured before the first forward, and checkpoint from them.
  - Or compose TP with FSDP2 (`fully_shard`), which keeps DTensor parameters registered and checkpoints exactly.""",
    fix='build the optimizer right after wrapping, before any forward, and checkpoint from the handles captured then; or compose TP with FSDP2 (fully_shard)',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed.tensor.parallel.ddp._pre_dp_module_transform', 'torch.distributed._composable.replicate'),
    source=('torch.distributed.tensor.parallel.ddp:_localize_dtensor', 'torch.distributed.tensor.parallel.ddp:_reconstruct_dtensor', 'torch.distributed.tensor.parallel.ddp:_update_module_param'),
    shows=(
        # one forward through the transform (every case draws one) empties the registry of its DTensors
        Shows(("check:parameter-names*", "check:parameters-count", "check:global-shapes", "check:requires_grad",
               "check:tied-parameters", "check:state_dict-names-and-global-shapes",
               "check:the-registry-holds-the-parameters-dp-captured"),
              ("registry_preserved",),
              (("dtensor_params", True),)),
        # after training, named_parameters() lacks the TP parameters
        Shows(("check:parameters-stay-registered-in-order",),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", DDP),)),
        # state_dict() holds local shards after wrapping and no TP key after a forward: the checkpoint
        # lacks them, load_state_dict and get_model_state_dict raise, get_optimizer_state_dict meets an
        # optimizer parameter the model no longer names (KeyError), and the model loads short of what was
        # saved, so the resumed step is not the uninterrupted one
        Shows(("check:state_dict-*", "check:every-rank-has-the-same-state_dict-entries",
               "check:replicas-agree-on-the-state_dict*", "check:the-loaded-model-*", "check:the-resumed-*",
               "raised:RuntimeError at torch/nn/modules/module.py:load_state_dict",
               "raised:RuntimeError at torch/distributed/checkpoint/state_dict.py:get_model_state_dict",
               "raised:KeyError at torch/distributed/checkpoint/state_dict.py:get_optimizer_state_dict"),
              ("*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP),)),
        # a first forward under no_grad (an eval forward first, or the one before building the
        # optimizer) leaves detached DTensors outside the registry that no later forward rebuilds: the
        # TP parameters never get a gradient (backward raises where every parameter is TP's; where some are
        # not, DDP's reducer waits for the TP shards' gradients: its next forward (replicate's pre-hook)
        # raises, or the others go unreduced and the replicas part)
        Shows(("raised:RuntimeError at torch/_tensor.py:backward",
               "raised:RuntimeError at torch/nn/parallel/distributed.py:forward",
               "raised:RuntimeError at torch/distributed/_composable/replicate.py:forward_pre_hook",
               "check:gradient-present-where-the-oracle-has-one",
               "check:trainable-parameters-move-as-in-the-oracle", "check:every-optimizer-state-is-there",
               "check:replicas-agree-on-*", "value:*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("eval_first", (True,)))),
        # the same, and the optimizer built after that forward gets no TP parameter: an empty list raises
        Shows(("raised:RuntimeError at torch/optim/*.py:__init__",
               "raised:RuntimeError at torch/_tensor.py:backward",
               "raised:RuntimeError at torch/nn/parallel/distributed.py:forward",
               "raised:RuntimeError at torch/distributed/_composable/replicate.py:forward_pre_hook",
               "check:gradient-present-where-the-oracle-has-one",
               "check:trainable-parameters-move-as-in-the-oracle", "check:every-optimizer-state-is-there",
               "check:replicas-agree-on-*", "value:*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("built", ("after_forward",)))),
    ),
    repro='f01_ddp_tp_params_unregistered_after_forward.py',
    upstream=('https://github.com/pytorch/pytorch/issues/152712',),  # closed; 2.13.0 still shows it
),
Fault(
    number=2,
    name='DP transform thaws frozen TP parameters',
    title='Frozen TP parameters become trainable',
    what="""`_flatten_tensor` calls `requires_grad_()` on every local shard, and `_localize_dtensor` wraps
each shard in `nn.Parameter(t)`, whose default is `requires_grad=True`: a frozen DTensor
parameter (`requires_grad=False`) comes back trainable. Both need the fix; FSDP1 reaches
`_flatten_tensor` through `DTensorExtensions.pre_flatten_transform`.

- **Caught by:** `flatten_roundtrip`, `fsdp_flatten_roundtrip`, and the training properties (`TheSameParametersAreTrainable`: a frozen layer moves after one step).""",
    consequence="""frozen layers, such as a frozen embedding or an adapter's base weights, train under DDP, `replicate` or FSDP1, and the optimizer holds state for them.""",
    workaround="""after wrapping, set `requires_grad_(False)` again on the parameters you froze (by name), and build the optimizer only from parameters that require grad.""",
    fix='after wrapping, set requires_grad_(False) again on the parameters you froze, by name',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate', 'fsdp1'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed._composable.replicate', 'FullyShardedDataParallel'),
    source=('torch.distributed.tensor.parallel._data_parallel_utils:_flatten_tensor',
            'torch.distributed.tensor.parallel.ddp:_localize_dtensor'),
    shows=(
        # _flatten_tensor calls requires_grad_() on every local shard, the user's own shard included
        Shows(("check:flatten-leaves-t-s-shard-requiring-grad-as-before",), ("flatten_roundtrip",)),
        Shows(("check:local-requires_grad", "check:requires_grad"),
              ("flatten_roundtrip",),
              (("requires_grad", False),)),
        # FSDP1's pre_flatten_transform is _flatten_tensor
        Shows(("check:pre_flatten-leaves-t-s-shard-requiring-grad-as-before",), ("fsdp_flatten_roundtrip",)),
        Shows(("check:pre_flatten-local-requires_grad", "check:post_unflatten-requires_grad"),
              ("fsdp_flatten_roundtrip",),
              (("requires_grad", False),)),
        # the transform thaws a frozen DTensor parameter right after wrapping
        Shows(("check:requires_grad",), ("registry_preserved",), (("frozen_dtensor", True),)),
        # frozen's TP'd mlp.w1 thawed: it trains (and the optimizer holds state for it), or backward meets
        # the tensors it left not requiring grad
        Shows(("check:the-same-parameters-are-trainable", "check:frozen-parameters-stay-unchanged",
               "check:gradient-present-where-the-oracle-has-one", "check:no-unexpected-optimizer-state",
               "raised:RuntimeError at torch/_tensor.py:backward", "value:*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP + ("fsdp1",)), ("model", ("frozen",)))),
        # the module DP is told to ignore, frozen by the user, is localized anyway (fault 11) and thawed:
        # it trains on each rank's own rows, unsynced
        Shows(("check:the-same-parameters-are-trainable", "check:frozen-parameters-stay-unchanged",
               "check:gradient-present-where-the-oracle-has-one", "check:no-unexpected-optimizer-state",
               "raised:RuntimeError at torch/_tensor.py:backward", "check:replicas-agree-on-*", "value:*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("habits.ignored", ("frozen",)), ("ignored_tp", True))),
    ),
    repro='f02_ddp_tp_thaws_frozen_params.py',
),
Fault(
    number=3,
    name='tied TP parameters come apart under DDP',
    title='Tied parameters come apart, and DDP cannot wrap them',
    what="""When two modules share one DTensor parameter (an embedding tied to the output head), the
transform localizes only one site of it (`_localize_dtensor` walks `named_parameters()`, which
names a shared parameter once). The other site keeps the DTensor. DDP's parameter sync
(`_sync_params_and_buffers`) then meets the DTensor beside the local shards and raises
`RuntimeError: aten.cat.default got mixed torch.Tensor and DTensor`; with `init_sync=False`
the backward raises the same; `replicate` raises in its first forward.

- **Caught by:** the training properties (`EveryRankTrainsWithoutAnException`, on the `tied` model).

- **Worse where some tp ranks hold empty shards.** The release profile (world size 8, not
  in this baseline) wraps `tied` with dim 1, hidden 2 on a (2, 4) mesh: the tp ranks with
  empty shards (2, 3, 6, 7) raise `aten.cat.default got mixed torch.Tensor and DTensor`
  while the others wait in DDP's collective for them. That is a hang in a user's job. The
  pool reports it as `RankFailed` after its error grace (the training loop says which ranks
  caught an exception), and the reference wraps and trains the same case. Replay: the
  release gate's report, or `trains_like_one_device.fn(pool, 'torch', case=TrainCase(model='tied',
  size=Size(dim=1, hidden=2, heads=2, vocab=4, seq=1), mesh_shape=(2, 4), local_batch=1))` on `RankPool(8)`.""",
    consequence="""a TP model with tied weights cannot be wrapped by `DDP(device_mesh=...)` or `replicate`.""",
    workaround="""use FSDP2 (`fully_shard`), tying the weights again after `parallelize_module`
(`model.head.weight = model.embed.weight`) with a plan that shards both alike: the embedding
`RowwiseParallel` and the head `ColwiseParallel` both shard the vocabulary rows, and the head's
logits may stay vocab-sharded for `loss_parallel` (`tests/test_plan.py` shows it). Or untie the
weights for training.""",
    fix='use FSDP2 (fully_shard), re-tying the weights after parallelize_module; or untie them',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed._composable.replicate'),
    source=('torch.distributed.tensor.parallel.ddp:_localize_dtensor',),
    shows=(
        # the transform localizes one site of a tied DTensor parameter; the other keeps the DTensor
        Shows(("check:tied-parameters", "check:parameters-count"),
              ("registry_preserved",),
              (("tied_dtensor", True),)),
        Shows(("check:other-dtensor-parameters-are-localized",),
              ("ignored_params_untouched",),
              (("tied_dtensor", True),)),
        # tied's embedding and head: DDP's parameter sync meets the DTensor (replicate's in its first
        # forward), or without the sync the backward mixes it with the local shard; where it runs, the
        # head's DTensor is a parameter of its own that DDP does not reduce: it trains apart, unsynced
        Shows(("raised:*Error at torch/nn/parallel/distributed.py:__init__",
               "raised:RuntimeError at torch/distributed/_composable/replicate.py:forward_pre_hook",
               "raised:RuntimeError at torch/_tensor.py:backward", "check:parameters-stay-registered-in-order",
               "check:no-unexpected-optimizer-state", "check:every-optimizer-state-is-there",
               "check:gradient-present-where-the-oracle-has-one",
               "check:trainable-parameters-move-as-in-the-oracle", "check:replicas-agree-on-*", "value:*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("ties", True))),
    ),
    repro='f03_ddp_tp_tied_params.py',
),
Fault(
    number=4,
    name='replaced parameter moves to the end of the registration order',
    title='A replaced parameter moves to the end of the registration order',
    what="""`_update_module_param` deletes the attribute and sets it again, which re-registers the
parameter last. TP's styles make every parameter of a module a DTensor, and localizing them
all restores the order; a module that mixes DTensor and plain parameters (parameters made
with `distribute_tensor` by hand, or an ignore list that leaves some of a module's
parameters alone) comes back reordered.

- **Caught by:** `paths_resolve` (`ReplacementKeepsTheRegistrationOrder`) and `ignored_params_untouched` (`NamesAndTheirOrderSurviveLocalize`).""",
    consequence="""- `named_parameters()` order differs from the unsharded model's.
  - Optimizer state and checkpoints that pair parameters by position (`optimizer.state_dict()`) pair the wrong ones.""",
    workaround="""pair parameters by name, never by position.""",
    fix='pair parameters by name, never by position',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed._composable.replicate'),
    source=('torch.distributed.tensor.parallel.ddp:_update_module_param',),
    shows=(
        # _update_module_param deletes and sets the attribute again: the slot moves last, whatever it holds
        Shows(("check:replacement-keeps-the-registration-order",), ("paths_resolve",)),
        # localizing with ignored parameters replaces the others the same way
        Shows(("check:names-and-their-order-survive-localize",),
              ("ignored_params_untouched",),
              (("dtensor_params", True),)),
    ),
    repro='f04_ddp_tp_reorders_params.py',
),
Fault(
    number=5,
    name='entry points that depart whatever the transform',
    title='Entry points that depart whatever the transform',
    what="""These failures occur with tpdp-verify's reference transform as well as with torch's, so
they are torch's entry points' own. The properties that cover them are
`entry_points_train_like_one_device`, `entry_points_state_dict_like_unsharded` and
`entry_points_checkpoint_resume`.

- **`replicate(device_mesh=...)` with TP.** It never trains an optimizer built after it. Its `state_dict()` after a forward holds local shards.

- **An optimizer built before wrapping** holds the DTensors the transform swapped out, so it never sees the gradients.

- **DDP with `static_graph=True` and `no_sync`** crashes, without TP too.

- **FSDP1 with a 2-D mesh:**
  - it cannot accumulate under `no_sync`, and on some layouts this hangs (docs/properties.md);
  - it cannot write back a sequence-parallel block on one dp rank (where FSDP1 falls back to `NO_SHARD`: fault 20);
  - on the CPU, `FSDP.optim_state_dict` reports `exp_avg` holding `exp_avg_sq` (its gather
    reuses one buffer for every state and "offloads" with a `.cpu()` that is a no-op there);
  - `get_optimizer_state_dict` loses the tp dimension.

- **DCP of DDP's optimizer state** gives every tp rank one rank's state.

- **DCP and `set_optimizer_state_dict`** cannot resume an optimizer when one of its parameters never got a gradient. This happens without TP too.""",
    consequence="""the optimizer of a `replicate`d or pre-wrap-built model trains nothing; accumulation, optimizer checkpoints and resumption fail or go wrong under the entry points named.""",
    workaround="""use FSDP2 `fully_shard` on the dp dimension, or DDP with the optimizer
built after wrapping. Checkpoint through `get_model_state_dict` or `state_dict`, not
through DCP's optimizer state.""",
    fix="use FSDP2 fully_shard on the dp dimension, or DDP with the optimizer built after wrapping; checkpoint through get_model_state_dict, not DCP's optimizer state",
    entry_points=('replicate', 'transform_ddp', 'ddp_mesh', 'fsdp1'),
    apis=('torch.distributed._composable.replicate', 'DistributedDataParallel(static_graph=True).no_sync', 'FullyShardedDataParallel.optim_state_dict', 'torch.distributed.checkpoint.state_dict.get_optimizer_state_dict'),
    source=('torch.distributed._composable.replicate:_ReplicateState.init', 'torch.distributed.fsdp._optim_utils:_allgather_orig_param_states'),
    shows=(
        # replicate localizes in its first forward: an optimizer built on it before that holds the
        # DTensors that forward swaps out, which never get a gradient
        Shows(("check:gradient-present-where-the-oracle-has-one", "check:every-optimizer-state-is-there",
               "check:no-unexpected-optimizer-state", "check:trainable-parameters-move-as-in-the-oracle",
               "check:replicas-agree-on-*", "value:*"),
              ("entry_points_train_like_one_device", "miswiring_refused_or_exact"),
              (("entry", ("replicate",)),)),
        # an optimizer built before wrapping holds the DTensors the transform swapped out: it never steps
        Shows(("check:gradient-present-where-the-oracle-has-one", "check:every-optimizer-state-is-there",
               "check:no-unexpected-optimizer-state", "check:trainable-parameters-move-as-in-the-oracle", "value:*",
               "raised:KeyError at torch/distributed/checkpoint/state_dict.py:get_optimizer_state_dict",
               "check:the-loaded-*", "check:the-resumed-*"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("built", ("before_wrap",)))),
        # DDP's static graph under no_sync: its reducer asserts in the backward, without TP too
        Shows(("raised:RuntimeError at torch/_tensor.py:backward",
               "raised:RuntimeError at torch/nn/parallel/distributed.py:forward"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("ddp.static_graph", True), ("accumulate", (2, 3)))),
        # FSDP1 with TP cannot accumulate under no_sync: its writeback raises (invalid python storage)
        # on the ranks whose flat shard holds a TP parameter, while the others wait
        Shows(("raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward", "hang"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("accumulate", (2, 3)))),
        # FSDP1's get_optimizer_state_dict loses the tp dimension (get_set, dcp); DCP of DDP's optimizer
        # state gives every tp rank one rank's state
        Shows(("check:the-loaded-optimizer-holds-the-saved-state", "check:the-resumed-*"),
              ("*checkpoint_resume*",),
              (("entry", ("fsdp1",)), ("route", ("get_set", "dcp")))),
        Shows(("check:the-loaded-optimizer-holds-the-saved-state", "check:the-resumed-*"),
              ("entry_points_checkpoint_resume",),
              (("entry", DDP), ("route", ("dcp",)))),
        # DCP and set_optimizer_state_dict cannot resume a parameter that never got a gradient (unused's
        # spare branch), whatever the entry point and without TP too
        Shows(("raised:CheckpointException at torch/distributed/checkpoint/utils.py:inner_func",
               "raised:RuntimeError at torch/distributed/checkpoint/state_dict.py:set_optimizer_state_dict"),
              ("*checkpoint_resume*",),
              (("model", ("unused",)), ("route", ("get_set", "dcp")))),
    ),
    repro='f05_entry_points_depart.py',
    upstream=('https://github.com/pytorch/pytorch/issues/152712', 'https://github.com/pytorch/pytorch/issues/143580'),
),
Fault(
    number=6,
    name="FSDP1's TP extension chunks uneven and HSDP tensors wrong",
    title="FSDP1's tensor-parallel extension (`DTensorExtensions`)",
    what="""- **`chunk_dtensor` with an unevenly sharded tp dimension.** It calls `from_local` without the global shape, so the ranks disagree on it (`ChunkDtensorAgreesOnTheGlobalShape...`).

- **A plain tensor on a 3-D (HSDP) mesh** is sharded across the replicas (`ChunkDtensorPlacements`).

- **`chunk_tensor`:**
  - it uses a tp-group rank where ShardedTensor expects a global rank, so ranks 2 and 3 raise `Global rank 0 does not exist` and `Global rank 1 does not exist` (`ChunkTensorRuns`);
  - it files tp rank 1's own shard under rank 0;
  - its offsets use floor division, so uneven pieces overlap.

FSDP1 with a device mesh always takes the `chunk_dtensor` path (a mesh sets `_use_dtensor`);
`chunk_tensor` is reached by calling the extension directly.""",
    consequence="""FSDP1 state dicts of TP models with uneven shapes, or on HSDP meshes, are wrong or fail to build.""",
    workaround="""keep every TP-sharded dimension divisible by the tp degree, or use FSDP2.""",
    fix='keep every TP-sharded dimension divisible by the tp degree, or use FSDP2',
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel(device_mesh=...)', 'torch.distributed.tensor.parallel.fsdp.DTensorExtensions'),
    source=('torch.distributed.tensor.parallel.fsdp:_chunk_dtensor', 'torch.distributed.tensor.parallel.fsdp:_chunk_tensor'),
    shows=(
        # chunk_dtensor calls from_local without the global shape: on uneven tp shards ranks disagree
        Shows(("check:chunk_dtensor-agrees-on-the-global-shape-on-every-rank-before-communicating",),
              ("chunk_dtensor_layout",),
              (("tp_uneven", True),)),
        # a plain tensor on HSDP's 3-D mesh is sharded over the replicate dimension
        Shows(("check:chunk_dtensor-placements", "check:chunk_dtensor-local-shape",
               "check:chunk_dtensor-local-values"),
              ("chunk_dtensor_layout",),
              (("tp_placement", (None,)), ("mesh_dims", (3,)))),
        # chunk_tensor places a DTensor's shard on its tp-group rank, which ShardedTensor reads as a
        # global rank: beyond the first dp group the rank does not exist
        Shows(("raised:ValueError at torch/distributed/tensor/parallel/fsdp.py:chunk_tensor",),
              ("chunk_tensor_metadata",),
              (("tp_placement", True), ("dp", (2, 3, 4, 5, 6, 7, 8)))),
        # ... and floor division sizes uneven pieces so that they overlap
        Shows(("raised:ValueError at torch/distributed/tensor/parallel/fsdp.py:chunk_tensor",),
              ("chunk_tensor_metadata",),
              (("tp_uneven", True),)),
        # ... and files tp rank 1's own shard under rank 0
        Shows(("check:chunk_tensor-local-shard-is-listed-in-the-metadata",),
              ("chunk_tensor_metadata",),
              (("tp_sharded", True), ("tp", (2, 3, 4, 5, 6, 7, 8)))),
        # FSDP1's state dict of an unevenly sharded TP model goes through the same chunking: a rank
        # aborts in gloo, or waits for one that raised
        Shows(("crash:SIGABRT", "hang"),
              ("*checkpoint_resume*", "*state_dict_like_unsharded"),
              (("entry", ("fsdp1",)), ("tp_uneven", True))),
    ),
    repro='f06_fsdp1_dtensor_extensions.py',
    upstream=('https://github.com/pytorch/pytorch/pull/123812', 'https://github.com/pytorch/pytorch/pull/188947'),
),
Fault(
    number=7,
    name='SequenceParallel thaws frozen parameters',
    title='SequenceParallel thaws frozen parameters',
    what="""`SequenceParallel._replicate_module_fn` wraps each parameter of a norm in a new
`nn.Parameter`, whose default is `requires_grad=True`. Every other style keeps the
original's flag (pytorch/pytorch#171709 fixed `distribute_module`, `ColwiseParallel` and
`RowwiseParallel`, not this one). No DP entry point is involved.

- **Caught by:** `tp_keeps_requires_grad` (`check:tp-keeps-requires_grad`) on `llama_sp`
  and `llama_lm`, with the reference transform too. The training properties met it first,
  with `Habits(ignored="frozen")` on `llama_sp` while the habit froze only before TP; the
  habit now freezes again after TP, as users who freeze a parallelized model do, so the
  training search goes on past it.""",
    consequence="""a norm frozen before `parallelize_module` trains, and the optimizer holds state for it.""",
    workaround="""freeze after `parallelize_module`.""",
    fix='freeze after parallelize_module',
    entry_points=(),
    apis=('parallelize_module', 'SequenceParallel'),
    source=('torch.distributed.tensor.parallel.style:SequenceParallel._replicate_module_fn',),
    shows=(
        # SequenceParallel's norms come back as new nn.Parameters, requiring grad
        Shows(("check:tp-keeps-requires_grad",),
              ("tp_keeps_requires_grad",),
              (("model", ("llama_sp", "llama_lm")),)),
    ),
    repro='f07_sequence_parallel_thaws_frozen.py',
),
Fault(
    number=8,
    name='clip_grad_norm_ misses the global norm',
    title='`clip_grad_norm_` does not see the global norm',
    what="""- **Under DDP with TP** (`ddp_mesh`, `transform_ddp`, `replicate`) each rank clips by the
  norm of what `model.parameters()` holds: its local shards, so tp ranks clip by different
  factors and replicas drift apart (with the reference transform too). On torch 2.13 the TP
  parameters are not in `parameters()` after a forward (fault 1): they are not clipped at all.

- **Under FSDP2 with TP** (`fully_shard`, `replicate_fsdp`) it raises `All operands in
  aten.stack.default must have the same mesh` when the plan leaves a parameter unsharded
  by TP (a norm): that one lives on the 1-D dp mesh, the rest on the 2-D mesh.

- **Caught by:** `entry_points_train_like_one_device` (`value:gradient-norm`, each rank's
  norm against the single-device one; `raised:RuntimeError` in the norm's `stack`).""",
    consequence="""replicas clip by different factors and drift apart (DDP), or training raises at the first clip (FSDP2); a job that clips trains other than one device would.""",
    workaround="""under DDP, compute the norm yourself: the squared norms of the local
  shards summed over the tp group (once for a Replicate parameter), then `clip_coef` on
  every gradient. Under FSDP2, give every parameter a TP style (norms `SequenceParallel`,
  as torchtitan does), so all live on the 2-D mesh.""",
    fix="under DDP sum the local shards' squared norms over the tp group yourself; under FSDP2 give every parameter a TP style so all live on one mesh",
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate', 'fully_shard', 'replicate_fsdp', 'fsdp1'),
    apis=('torch.nn.utils.clip_grad_norm_', 'torch.nn.utils.get_total_norm', 'FullyShardedDataParallel.clip_grad_norm_'),
    source=('torch.nn.utils.clip_grad:_get_total_norm', 'torch.nn.utils.clip_grad:clip_grad_norm_'),
    shows=(
        # under DDP each tp rank clips by its own shards' norm, and not the TP parameters after a forward
        Shows(("value:*", "check:replicas-agree-on-*"),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", DDP), ("habits.clip", True))),
        # under FSDP2 a parameter no TP style covers lives on the 1-D dp mesh, the rest on the 2-D one:
        # the norm's stack refuses them (a plain norm or layer in the plan's model, or an ignored module)
        Shows(("raised:RuntimeError at torch/nn/utils/clip_grad.py:*",),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", ("fully_shard", "replicate_fsdp")),
               ("habits.clip", True),
               ("model", ("nested", "llama", "frozen")))),
        Shows(("raised:RuntimeError at torch/nn/utils/clip_grad.py:*",),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", ("fully_shard", "replicate_fsdp")), ("habits.clip", True), ("habits.ignored", True))),
        # FSDP1's clip_grad_norm_ reduces the norm of each rank's flat shards over the dp group only: the
        # tp ranks clip by factors of their own
        Shows(("value:*", "check:replicas-agree-on-*"),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", ("fsdp1",)), ("habits.clip", True))),
        # ... and folds an ignored module's DTensor gradients in with its plain flat shards: DTensor's
        # dispatch asserts (FSDP1 without TP clips the same case)
        Shows(("raised:AssertionError at torch/distributed/fsdp/fully_sharded_data_parallel.py:clip_grad_norm_",),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", ("fsdp1",)), ("habits.clip", True), ("ignored_tp", True))),
    ),
    repro='f08_clip_grad_norm_not_global.py',
    upstream=('https://github.com/pytorch/pytorch/issues/180346',),
),
Fault(
    number=9,
    name='activation checkpointing under DDP with TP',
    title='Activation checkpointing, or a block called directly, under DDP with TP',
    what="""The DDP transform's forward hook makes the parameters local shards again after the
forward; a checkpointed block recomputed in the backward then meets local shards where
the forward had DTensors (`CheckpointError: Recomputed values ... have different
metadata`, or `mixed torch.Tensor and DTensor`). torch 2.13's transform escapes it only
through fault 1 (its DTensors stay outside the registry, where the recomputation finds
them) except for tied weights (fault 3), where the tie's other site breaks the
recomputation; the reference transform, which keeps the registry, raises on every model.
On torch 2.13 the tied case fails without checkpointing too (fault 3's mixed
`torch.Tensor` and DTensor in the backward, with `init_sync=False`); checkpointing changes
the failure to `CheckpointError`.

A block called directly between steps (`ddp.module.w2(h)`, `Habits(between="submodule")`)
meets the same: the transform's hooks are the root's, so between forwards a TP block
holds local shards, and with the reference the call raises `mixed torch.Tensor and
DTensor`. torch 2.13 computes it right, through fault 1 again, so it has no entry of its
own; a torch whose fix of fault 1 keeps the registry the reference's way raises
there, and the gate reports it NEW (`raised:RuntimeError at torch/nn/modules/linear.py:forward`
in `entry_points_train_like_one_device`).

- **Caught by:** `entry_points_train_like_one_device` (`raised:CheckpointError`).""",
    consequence="""a fix of fault 1 must keep the TP parameters as DTensors until the
  backward is done, and give a block called on its own its DTensors (hooks on each TP
  module, not only the root), or activation checkpointing and direct calls with DDP and
  TP break.""",
    workaround="""FSDP2 (`fully_shard` or its `replicate`) with activation checkpointing trains exactly.""",
    fix='use FSDP2 (fully_shard or its replicate) with activation checkpointing',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate'),
    apis=('torch.utils.checkpoint', 'torch.distributed._composable.checkpoint', 'DistributedDataParallel(device_mesh=...)'),
    source=('torch.distributed.tensor.parallel.ddp:_pre_dp_module_transform',),
    shows=(
        # a checkpointed block recomputed in the backward meets local shards where the forward had DTensors
        # (CheckpointError), or plain tensors among DTensors (replicate: mixed torch.Tensor and DTensor in a
        # block's Linear; gone without checkpointing)
        Shows(("raised:CheckpointError at torch/_tensor.py:backward",
               "raised:RuntimeError at torch/nn/modules/linear.py:forward"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", DDP), ("habits.checkpoint", True))),
    ),
    repro='f09_checkpoint_under_ddp_tp.py',
),
Fault(
    number=10,
    name='crossed meshes torch accepts',
    title='Crossed meshes that torch accepts',
    what="""`miswiring_refused_or_exact` gives each entry point a mesh a user can get wrong
(docs/properties.md). Most refuse before training. These do not:

- **DP given `mesh["tp"]`** (`DDP(device_mesh=mesh["tp"])`, `transform_ddp` on the tp group,
  `replicate(device_mesh=mesh["tp"])`, FSDP1 too; FSDP2 refuses it) is accepted: DDP's initial broadcast copies tp rank
  0's shards over the other tp ranks' (every parameter is off before the first step), and
  each step averages different shards. Replay: `TrainCase(model="mlp", size=Size(dim=1,
  hidden=2), mesh_shape=(2, 2), entry="ddp_mesh", wiring="dp_over_tp")`.

- **The same with shards of unequal size hangs.** DDP's check that every rank's parameters
  have the same shapes raises on the tp ranks whose shard differs from rank 0's, while rank
  0 goes on into the next collective and waits: a hang in a user's job
  (`raised:RuntimeError at torch/nn/parallel/distributed.py:__init__`, raised in
  `_verify_param_shape_across_processes`, the report naming the rank left waiting;
  `replicate`'s the same at its `forward_pre_hook`).
  FSDP1 given `mesh["dp"]` crossed with TP on the tied model aborts a rank (`crash:SIGABRT`).
  Replay: `TrainCase(model="mlp", size=Size(dim=4, hidden=3), mesh_shape=(2, 2),
  entry="ddp_mesh", wiring="dp_over_tp")`.

- **TP applied over `mesh["dp"]`** is accepted by every DDP entry point and FSDP1 (FSDP2 refuses it): the model trains
  sharded over dp and replicated over tp, and its frozen layers thaw (fault 2). Replay:
  `TrainCase(model="frozen", mesh_shape=(2, 2), entry="transform_ddp", wiring="tp_over_dp")`.

- **Refusals that are not about the mesh** are findings too: DDP given a process group
  while its parameters are DTensors raises `NotImplementedError` (`c10d.broadcast_` has no
  sharding strategy) at DDP's `__init__`, and FSDP1 given the whole 2-D mesh raises
  `resize_() on an invalid python storage` at FSDP's `__init__`, as does FSDP1 given the
  dp process group (`process_group=mesh["dp"].get_group()`, where it installs no DTensor
  extension; with the Llama model: `aten.cat.default got mixed torch.Tensor and DTensor`,
  flattening). Neither says what is wrong,
  and an exception of any cause before the first step passed for a refusal before
  (`oracles/verdicts.py`, `refusal`: the error must speak of the mesh or the group).

Each replay: `miswiring_refused_or_exact.fn(pool, "torch", case=...)` on `RankPool(4)`.""",
    consequence="""a crossed mesh trains, silently wrong (every parameter off before the first step,
  replicas averaging different shards), or hangs a job; the refusals that are not about the
  mesh do not tell the user what is wrong.""",
    workaround="""hand DP `mesh["dp"]` and TP `mesh["tp"]`; `tpdp-verify plan` refuses
a `parallelize_fn` that crosses them, with one line, before training.""",
    fix='hand DP mesh["dp"] and TP mesh["tp"]',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate', 'fsdp1'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed._composable.replicate', 'FullyShardedDataParallel(device_mesh=...)', 'parallelize_module'),
    source=('torch.nn.parallel.distributed:DistributedDataParallel.__init__',),
    shows=(
        # DP given mesh["tp"], or TP over mesh["dp"], accepted: DDP's broadcast and average mix different
        # shards, unequal shards fail DDP's shape check (replicate's in its first forward) while a rank
        # waits, FSDP1 flattens and writes back the crossed shards or aborts
        Shows(("check:refuses-a-miswiring-before-training-or-trains-exactly", "check:replicas-agree-on-*",
               "value:*", "check:trainable-parameters-move-as-in-the-oracle",
               "raised:RuntimeError at torch/nn/parallel/distributed.py:__init__",
               "raised:RuntimeError at torch/distributed/_composable/replicate.py:forward_pre_hook",
               "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward",
               "crash:SIGABRT", "hang"),
              ("miswiring_refused_or_exact",),
              (("wiring", ("dp_over_tp", "tp_over_dp")), ("entry", DDP + ("fsdp1",)))),
        # refusals not about the mesh: DDP given a process group meets DTensor parameters in its broadcast,
        # FSDP1 given the whole 2-D mesh or the dp group fails flattening them
        Shows(("check:refuses-a-miswiring-before-training-or-trains-exactly",
               "raised:*Error at torch/nn/parallel/distributed.py:__init__"),
              ("miswiring_refused_or_exact",),
              (("wiring", ("dp_by_group",)), ("entry", DDP))),
        Shows(("check:refuses-a-miswiring-before-training-or-trains-exactly",
               "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:*"),
              ("miswiring_refused_or_exact",),
              (("wiring", ("dp_over_mesh", "dp_by_group")), ("entry", ("fsdp1",)))),
    ),
    repro='f10_crossed_meshes_accepted.py',
),
Fault(
    number=11,
    name='DDP localizes the parameters it is told to ignore',
    title='DDP with TP, and `replicate()`, localize what they are told to ignore',
    what="""A user keeps a module out of DP (DDP's `_set_params_and_buffers_to_ignore_for_model`,
`replicate(ignored_modules=...)`, FSDP's `ignored_params`/`ignored_modules`) to train it
apart, or because it is frozen. DP's contract is to leave it alone. With TP:

- **DDP** (`DDP(device_mesh=...)` and `_pre_dp_module_transform`) calls
  `_localize_dtensor(module, None, None)`: the ignore list never reaches it, and every
  DTensor parameter, the ignored ones too, is replaced by its plain local shard at wrapping.

- **`replicate()`** passes its ignored parameters to `_localize_dtensor` at wrapping, but the
  forward hook it registers for TP (`module.register_forward_hook(_localize_dtensor)`) is
  called with no ignore list: after the first forward the ignored ones are local shards too.

- **FSDP1, `fully_shard` and the FSDP2-based `replicate`** leave them as they were.

- **The fix is at hand:** the user names the ignore list on the module before wrapping
  (`_set_params_and_buffers_to_ignore_for_model` sets `_ddp_params_and_buffers_to_ignore`),
  and DDP reads it only after the transform ran; tpdp-verify's reference transform reads it
  first and leaves those parameters alone at wrapping and after every forward, and trains
  exactly (`--impl reference`).

- **Caught by:** every training property whose case draws `Habits(ignored=...)`
  (`check:what-dp-is-told-to-ignore-stays-as-the-user-left-it`, which names each parameter and
  when it changed: `w1.weight is localized after wrapping (a DTensor the user left)`);
  tests/test_ignored.py runs each entry point on the MLP.""",
    consequence="""the ignored module holds local shards where the user's code expects
  DTensors: an optimizer or a checkpoint built from it sees shards with no layout, and a
  user's own gradient sync over dp runs on what DP, not TP, left there.""",
    workaround="""`fully_shard` or the FSDP2-based `replicate` with `ignored_params`, which
  leave them alone (tested); with DDP, nothing short of keeping the module out of the
  wrapped model.""",
    fix='use fully_shard or the FSDP2-based replicate with ignored_params',
    entry_points=('transform_ddp', 'ddp_mesh', 'replicate'),
    apis=('DistributedDataParallel._set_params_and_buffers_to_ignore_for_model', 'torch.distributed._composable.replicate(ignored_modules=...)'),
    source=('torch.distributed.tensor.parallel.ddp:_localize_dtensor', 'torch.distributed.tensor.parallel.ddp:_pre_dp_module_transform', 'torch.distributed._composable.replicate:replicate'),
    shows=(
        # DDP localizes every DTensor at wrapping, replicate's hook after each forward: the ignored ones too
        Shows(("check:what-dp-is-told-to-ignore-stays-as-the-user-left-it",),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", DDP), ("ignored_tp", True))),
    ),
    repro='f11_dp_localizes_ignored_params.py',
),
Fault(
    number=12,
    name='FSDP1 with TP leaves a pre-wrap optimizer untrained',
    title='With TP, FSDP1 trains nothing an optimizer built before wrapping holds',
    what="""FSDP1 with `use_orig_params=True` keeps the user's parameters, so an optimizer built on the
model before wrapping trains it: plain FSDP1 does, and tpdp-verify drew no such case until
an exclusion said both FSDP versions replace the parameters (FSDP2 does; its exclusion
stays, `tests/test_exclusions.py` shows it departing without TP too). With TP the
parameters are DTensors, and after wrapping the model computes with others, rebuilt from
FSDP1's flat shards by its TP extension (`DTensorExtensions`): the optimizer's DTensors get
no gradient, and its steps move nothing the model computes with.

- **Caught by:** `entry_points_train_like_one_device` (`trainable parameters move as in the
  oracle` + `value:parameter`, every parameter staying where it was), and
  `entry_points_checkpoint_resume`, where `get_optimizer_state_dict` raises `KeyError` on the
  DTensors the optimizer holds and the model no longer does.""",
    consequence="""an optimizer built before FSDP1 wraps a TP'd model never moves the weights the model computes with, silently; resuming from its state raises `KeyError`.""",
    workaround="""build the optimizer on the wrapped model (`fsdp.parameters()`).""",
    fix='build the optimizer on the wrapped model (fsdp.parameters())',
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel(use_orig_params=True)', 'torch.optim'),
    source=('torch.distributed.fsdp._flat_param:FlatParamHandle._init_flat_param_and_metadata',),
    shows=(
        # the optimizer built before FSDP1 wraps holds DTensors the model no longer computes with
        Shows(("check:trainable-parameters-move-as-in-the-oracle",
               "check:gradient-present-where-the-oracle-has-one", "value:parameter", "value:gradient"),
              ("*train*", "miswiring_refused_or_exact"),
              (("entry", ("fsdp1",)), ("built", ("before_wrap",)))),
        # ... and get_optimizer_state_dict meets them, named by no module
        Shows(("raised:KeyError at torch/distributed/checkpoint/state_dict.py:get_optimizer_state_dict",),
              ("*checkpoint_resume*",),
              (("entry", ("fsdp1",)), ("built", ("before_wrap",)))),
    ),
    repro='f12_fsdp1_tp_optimizer_before_wrap.py',
),
Fault(
    number=13,
    name='loss_parallel hangs on an empty vocab shard',
    title='`loss_parallel` over a vocab that leaves a tp rank no column hangs',
    what="""`ColwiseParallel` on an output head shards the vocab with `torch.chunk`: a vocab of 5 over
4 tp ranks gives 2, 2, 1 and 0 columns. Under `loss_parallel()`, the cross entropy raises
on the rank with none (`RuntimeError: index 0 is out of bounds for dimension 1 with size 0`,
in `_nll_loss_forward`) while the others wait for it in a collective: the job hangs (on
gloo, some of the waiting ranks fail with `Connection closed by peer` once the raising rank
exits; the others stay blocked). The empty rank also skips `_log_softmax`'s MAX all-reduce
(`x.numel() == 0`), so its collectives pair with the wrong ones before it raises: a fix of
the gather alone leaves them mismatched. An
exclusion (`vocab_empty_shard`) kept such vocabs out of every draw, for the hang; a hang is a
finding, and the zoo's `llama_lm` and `tied` now draw any vocab from 2 to 32.

- **Caught by:** any training or checkpoint property that draws `llama_lm` with such a
  vocab on 4 tp ranks, such as `state_dict_like_unsharded` and
  `entry_points_state_dict_like_unsharded` at world size 4
  (`raised:RuntimeError at torch/nn/functional.py:cross_entropy`; the ranks left waiting
  are named in the report).""",
    consequence="""a job whose vocab does not fill every tp rank hangs at its first loss, with no error on the ranks that wait.""",
    workaround="""a vocab that every tp rank gets a column of (pad it to a multiple of tp,
  as Megatron and torchtitan do).""",
    fix='pad the vocab to a multiple of the tp degree',
    entry_points=(),
    apis=('torch.distributed.tensor.parallel.loss_parallel', 'ColwiseParallel'),
    source=('torch.distributed.tensor.parallel.loss:_log_softmax', 'torch.distributed.tensor.parallel.loss:_nll_loss_forward'),
    shows=(
        # loss_parallel's cross entropy (and nll_loss) raises on the tp rank with no vocab column while
        # the others wait in a collective: llama_lm's own loss, or a drawn loss under loss_parallel
        Shows(("raised:RuntimeError at torch/nn/functional.py:cross_entropy",
               "raised:RuntimeError at torch/nn/functional.py:nll_loss", "hang"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("model", ("llama_lm",)), ("loss", (None,)), ("vocab_empty", True))),
        Shows(("raised:RuntimeError at torch/nn/functional.py:cross_entropy",
               "raised:RuntimeError at torch/nn/functional.py:nll_loss", "hang"),
              ("losses_train_like_one_device",),
              (("loss.parallel", True), ("vocab_empty", True))),
    ),
    repro='f13_loss_parallel_empty_vocab_shard.py',
),
Fault(
    number=14,
    name='FSDP1 summon_full_params(with_grads=True) aborts in half precision',
    title='FSDP1 alone, in half precision, aborts a rank reading gradients with `summon_full_params`',
    what="""Not the composition's: FSDP1 without TP. `FSDP.summon_full_params(with_grads=True)` gathers
each rank's gradient shard; where a rank's flat-parameter shard holds only frozen
parameters, its gradient is `None` and `FlatParamHandle.unshard_grad` stands in zeros built
with no dtype (float32). In bfloat16 or float16 the all-gather then meets float32 beside
half precision: one rank raises (`attempting to assign a gradient with dtype 'float' to a
tensor with grad_dtype 'BFloat16'`) and another aborts in gloo (`Received data size doesn't
match expected size`). Training itself runs; reading the gradients kills the job. An
ignored module is one way to leave a rank only frozen parameters (the `frozen` model with
its first layer ignored); a `Sequential(frozen Linear, Linear)` does it without one, and so
does TP where it leaves a rank's shard no element at all. The fix is one dtype argument.

- **Caught by:** no property's verdict: the explaining run (the same DP entry point without
  TP) meets it beside a TP+DP failure, `could not be run: rank 2 of 4 was killed by
  SIGABRT`; tests/test_training.py keeps it under test.""",
    consequence="""a job that reads FSDP1's full gradients (for logging, clipping or a check) in half
  precision dies with a gloo error that says nothing of the cause.""",
    workaround="""read gradients in float32, or keep a trainable parameter in every rank's shard (no
  ignored module that leaves a rank only frozen ones); FSDP2 (`fully_shard`) reads
  gradients as DTensors without a gather.""",
    fix="read FSDP1's gradients in float32, or keep a trainable parameter in every rank's shard; or use FSDP2",
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel.summon_full_params(with_grads=True)', 'FullyShardedDataParallel(ignored_modules=...)'),
    source=('torch.distributed.fsdp._flat_param:FlatParamHandle.unshard_grad',),
    shows=(
        # reading the gradients gathers float32 zeros beside half precision from a rank whose
        # shard holds no trainable element: TP's empty shards leave one such too
        Shows(("crash:SIGABRT",),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("dtype", ("bfloat16", "float16")), ("tp_empty", True))),
        # frozen's frozen layer fills the shards of some ranks where the dp ranks are many
        Shows(("crash:SIGABRT",),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("dtype", ("bfloat16", "float16")), ("model", ("frozen",)))),
    ),
    repro='f14_fsdp1_ignored_half_precision_abort.py',
),
Fault(
    number=15,
    name='loss_parallel log_softmax backward',
    title='Under `loss_parallel`, `log_softmax` backpropagates as if `nll_loss` came next',
    what="""`loss_parallel()` replaces the backward of `log_softmax` over vocab-sharded logits by the
identity (`_log_softmax_backward_handler` returns the incoming gradient), because its
`nll_loss` backward already produces the gradient of the fused cross entropy with respect
to the logits. Cross entropy, and `nll_loss` of the log-probabilities, are right. Any other
loss over the log-probabilities gets wrong gradients, silently: a KL divergence to a
teacher's distribution (distillation), a preference loss that sums weighted log-probs over
the vocabulary. Its docstring says only cross entropy is supported; the others run and
train wrong rather than refuse. No DP entry point is involved.

- **Caught by:** `losses_train_like_one_device` (`value:gradient`) on `teacher_kl` under
  `loss_parallel`, every entry point, `tied` and `llama_lm`.""",
    consequence="""distillation or any loss over log-probabilities other than cross
  entropy, computed under `loss_parallel()` over vocab-sharded logits, trains on wrong
  gradients.""",
    workaround="""compute such losses outside `loss_parallel()` (DTensor then redistributes
  the logits, or gather them with `full_tensor()`); keep `loss_parallel()` for cross entropy.""",
    fix='compute losses other than cross entropy outside loss_parallel()',
    entry_points=(),
    apis=('torch.distributed.tensor.parallel.loss_parallel', 'torch.nn.functional.log_softmax'),
    source=('torch.distributed.tensor.parallel.loss:_log_softmax_backward_handler',),
    shows=(
        # log_softmax's backward under loss_parallel is the identity: a KL loss's gradients are wrong
        Shows(("value:*",),
              ("losses_train_like_one_device",),
              (("loss.kind", ("teacher_kl",)), ("loss.parallel", True))),
    ),
    repro='f15_loss_parallel_log_softmax_grad.py',
    upstream=('https://github.com/pytorch/pytorch/issues/190746', 'https://github.com/pytorch/pytorch/pull/191606'),
),
Fault(
    number=16,
    name="FSDP2 sums TP's partial gradients outside reduce_dtype",
    title="Under a float32 `reduce_dtype`, FSDP2 sums TP's partial gradients in bfloat16",
    what="""A parameter TP replicates over tp while each tp rank sees only part of what it acts on (a
`SequenceParallel` norm's weight: each rank holds a slice of the sequence) has a partial
sum for a gradient on each tp rank. FSDP2 all-reduces it over tp in
`FSDPParam._get_grad_inner_tensor` before its own reduce-scatter over dp, in the dtype the
gradient has: the compute dtype. Under `MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`, torchtitan's policy, that sum runs in bfloat16, though the
policy says gradients are reduced in float32. A gradient accumulated over microbatches
(`set_requires_gradient_sync(False)`) is cast to `reduce_dtype` before it is summed
(`to_accumulated_grad_if_needed`), so that path is right, and the same model trains to
different precision with and without accumulation. The fix is one cast: `--impl reference` casts the
gradients to `reduce_dtype` before the sum (tpdp_verify/impls/fsdp2_sums.py) and passes.

- **Caught by:** `trains_like_plain_ddp` (`check:tp-sums-a-step-s-gradients-in-the-reduce-dtype`)
  under `fully_shard` and `replicate_fsdp` with a mixed-precision policy, on `llama_sp` and
  `llama_lm`: the reduced gradient is 3e-5 off the exact sum of the ranks' partial sums,
  where float32 allows 2e-9 (docs/tolerance.md, "TP's sums under a policy").""",
    consequence="""the norms' gradients carry bfloat16's rounding (2^-9 of the sum) into
  the float32 reduction and the optimizer; the loss of precision `reduce_dtype=float32` is
  there to prevent, for exactly the parameters (norm scales) most sensitive to it.""",
    workaround="""none that keeps the policy and one microbatch a step. Two or more
  microbatches a step (`set_requires_gradient_sync(False)` on all but the last) take the
  path that sums in float32, as the replay shows; a policy without `param_dtype` computes
  and sums in float32. The fix in torch is one cast in `_get_grad_inner_tensor` (the
  reference's: tpdp_verify/impls/fsdp2_sums.py).""",
    fix='two or more microbatches a step, or a policy without param_dtype',
    entry_points=('fully_shard', 'replicate_fsdp'),
    apis=('fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))',),
    source=('torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._get_grad_inner_tensor',),
    shows=(
        # TP's partial sums are all-reduced in the compute dtype before FSDP2's own reduction
        Shows(("check:tp-sums-a-step-s-gradients-in-the-reduce-dtype",),
              ("*trains_like_plain_d*",),
              (("entry", ("fully_shard", "replicate_fsdp")), ("fsdp.mixed_precision", True))),
    ),
    repro='f16_fsdp2_tp_reduce_dtype.py',
    upstream=('https://github.com/pytorch/pytorch/issues/190626', 'https://github.com/pytorch/pytorch/pull/190627'),
),
Fault(
    number=17,
    name='FSDP2 over the SPMD mesh scales gradients by 1/dp',
    title='Over the whole SPMD mesh, FSDP2 scales every gradient by 1/dp',
    what="""`fully_shard(model, mesh=<the whole mesh>, dp_mesh_dims=DataParallelMeshDims(...))` (and
FSDP2's `replicate` with `dp_mesh_dims`) takes parameters that are DTensors on the whole
mesh, `Replicate()` on the dp dimensions. The batch is a DTensor sharded on dp and the loss
a DTensor reduced over the global batch, so each parameter's gradient comes out of
autograd as a partial sum over dp whose sum is one device's gradient: DTensor alone, with
no wrapper, trains exactly like one device (tests/test_large_dp.py). `FSDPParam._get_grad_inner_tensor`
keeps those partial sums pending over dp, "so FSDP's reduce-scatter handles them directly",
and the reduce-scatter (or the all-reduce of the replicating form) averages them, as it
averages the whole gradients of the sub-mesh form: a second division by the dp degree.

- **Caught by:** `large_dp_trains_like_one_device` (`value:gradient`, max rel 1 - 1/dp) and
  `large_dp_trains_like_plain_dp` against the DTensor program without the wrapper, in every
  form (`shard`, `replicate`, `both`), on 2-D and 3-D meshes, whatever the loss's reduction;
  `losses_train_like_one_device` in the SPMD form through FSDP2, whatever the loss (the
  same loss through the DTensor program alone trains exactly, unless fault 31 meets it).

- **Beside it:** under a `MixedPrecisionPolicy` whose `param_dtype` is not the data's (float16
  batches, bfloat16 parameters), the SPMD form's DTensor batches reach the first layer
  uncast: "mat1 and mat2 must have the same dtype, but got BFloat16 and Half"
  (`large_dp_trains_like_plain_dp`, `raised:RuntimeError at torch/nn/modules/linear.py:forward`;
  the DTensor program without FSDP2, which has no policy, trains).""",
    consequence="""every step is 1/dp of the step one device or the same program without
  FSDP takes: under SGD a learning rate silently divided by the dp degree; Adam hides most
  of it (its update is scale-free but for eps), clipping by a total norm does not.""",
    workaround="""`model.set_gradient_divide_factor(1.0)` on every FSDP2 module after
  wrapping makes the reduction a sum: with it the replicating form trains exactly on gloo;
  the sharding forms then reduce-scatter with `PREMUL_SUM`, which NCCL has and gloo lacks
  ("Cannot use ReduceOp.PREMUL_SUM with Gloo").""",
    fix='model.set_gradient_divide_factor(1.0) on every FSDP2 module after wrapping',
    entry_points=('fully_shard', 'replicate_fsdp'),
    apis=('fully_shard(mesh, dp_mesh_dims=...)',),
    source=('torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._get_grad_inner_tensor',),
    shows=(
        # over the whole SPMD mesh every gradient is averaged over dp a second time
        Shows(("value:*",),
              ("large_dp_*", "losses_train_like_one_device"),
              (("entry", ("fully_shard", "replicate_fsdp")), ("dp_mesh_dims", True))),
        # ... and under a policy casting to another dtype than the data's, the DTensor batches reach the
        # first layer uncast
        Shows(("raised:RuntimeError at torch/nn/modules/linear.py:forward",),
              ("large_dp_*",),
              (("entry", ("fully_shard", "replicate_fsdp")), ("dp_mesh_dims", True), ("policy_casts", True))),
    ),
    repro='f17_fsdp2_spmd_grad_scale.py',
),
Fault(
    number=18,
    name='FSDP1 hybrid with a one-rank shard group never syncs replicas',
    title="FSDP1's hybrid strategies with a shard group of one rank never synchronize the replicas",
    what="""FSDP1 with `HYBRID_SHARD` or `_HYBRID_SHARD_ZERO2` on a 2-D device mesh whose shard
dimension is 1 (a (dp_replicate, dp_shard, tp) = (2, 1, 2) mesh, as a job that grows its
replicas before its shards has) warns that it is "switching to use `NO_SHARD` instead of
ShardingStrategy.HYBRID_SHARD since the world size is 1" and reduces each gradient over
that one rank only: the all-reduce over the replicate dimension never runs. Each replica
steps with its own rows' gradients, without TP too. With TP, FSDP1's hybrid strategies show
FSDP1's own TP faults besides: where the shard group is one rank, `summon_full_params`
raises "Cannot writeback when the parameter shape changes" (as FSDP1 with TP on one dp
rank does, fault 6), and under `no_sync` the flat parameter's storage is invalid.

- **Caught by:** `large_dp_trains_like_plain_dp` (`check:the-same-dp-without-tp-keeps-its-replicas-in-step`:
  the plain-DP oracle's own replicas disagree, so there is nothing to judge by) and
  `large_dp_trains_like_one_device` (`check:replicas-agree-on-grads`, `value:gradient`);
  the raises as `raised:RuntimeError at .../fully_sharded_data_parallel.py:summon_full_params`
  and `...:forward`.""",
    consequence="""the replicas drift apart from the first step, silently but for the warning.""",
    workaround="""`FULL_SHARD` (or `NO_SHARD`) over the dp ranks flattened when the shard
  dimension is 1; or FSDP2's `fully_shard` on `mesh["dp_replicate", "dp_shard"]`, which
  trains exactly there.""",
    fix='FULL_SHARD over the dp ranks flattened, or FSDP2 fully_shard on the (dp_replicate, dp_shard) mesh',
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel(sharding_strategy=HYBRID_SHARD, device_mesh=...)',),
    source=('torch.distributed.fsdp._init_utils:_init_core_state', 'torch.distributed.fsdp._runtime_utils:_reduce_grad_no_shard'),
    shows=(
        # a hybrid strategy with a shard group of one rank falls back to NO_SHARD and never all-reduces
        # over the replicas; FSDP1's TP faults of one-rank groups (write-back) and no_sync come with it
        Shows(("check:the-same-dp-without-tp-keeps-its-replicas-in-step", "check:replicas-agree-on-*", "value:*",
               "raised:*Error at torch/distributed/fsdp/fully_sharded_data_parallel.py:summon_full_params",
               "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"),
              ("large_dp_*",),
              (("entry", ("fsdp1",)),
               ("fsdp1_strategy", ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")),
               ("dp_shard", (1,)))),
    ),
    repro='f18_fsdp1_hybrid_one_rank_shard_group.py',
    upstream=('https://github.com/pytorch/pytorch/issues/154888',),
),
Fault(
    number=19,
    name='DTensor programs that fail on the CPU in the SPMD form',
    title='DTensor programs that fail on the CPU in the SPMD form',
    what="""The SPMD form runs the model's forward as DTensor's own program (no TP hooks turning
DTensors into local tensors between modules), and DTensor cannot run three of the zoo's
models on the CPU, with or without a DP wrapper (the plain-DP oracle, the program alone,
fails the same way, so `large_dp_trains_like_plain_dp` passes them and
`large_dp_trains_like_one_device` records them):
`aten._scaled_dot_product_flash_attention_for_cpu` has no sharding strategy (the Llama
models' attention; CUDA's attention kernels have one), a vocab-sharded embedding whose
input is sharded on dp applies its mask to the wrong shape (`IndexError: The shape of the
mask [2, 4] at index 0 does not match the shape of the indexed tensor`, the tied model), and
`llama_lm`'s embedding output fails an assert in `_reduce_shard_value`.

- **Caught by:** `large_dp_trains_like_one_device` (`raised:NotImplementedError`,
  `raised:IndexError`, `raised:AssertionError` under DTensor's dispatch), in the SPMD form
  of those models; `losses_train_like_one_device` in the SPMD form of `llama_lm` and `tied`,
  with FSDP2 or with no wrapper (`lm_head`, a head over features, runs there).""",
    consequence="""a model whose attention is `scaled_dot_product_attention` cannot be
  verified in the SPMD form on CPU ranks; the MLP-shaped models are, and show fault 17.""",
    workaround="""none on the CPU; the NCCL backend reaches CUDA's attention kernels.""",
    fix="none on the CPU; the NCCL backend reaches CUDA's attention kernels",
    entry_points=('fully_shard', 'replicate_fsdp'),
    apis=('DTensor', 'torch.nn.functional.scaled_dot_product_attention'),
    source=('torch.distributed.tensor._sharding_prop:ShardingPropagator.propagate_op_sharding_non_cached', 'torch.distributed.tensor.placement_types:_MaskPartial._reduce_value'),
    shows=(
        # DTensor's own program of these models fails on the CPU: SDPA has no sharding strategy, the
        # tied embedding's mask, llama_lm's embedding output; on one dp rank the attention's view of the
        # dp-sharded batch already fails sharding propagation (in wq's Linear)
        Shows(("raised:NotImplementedError at torch/distributed/tensor/_dispatch.py:*",
               "raised:AssertionError at torch/distributed/tensor/_dispatch.py:*", "raised:IndexError at *",
               "raised:RuntimeError at torch/nn/modules/linear.py:forward"),
              ("large_dp_*", "losses_train_like_one_device"),
              (("entry", ("fully_shard", "replicate_fsdp", "dtensor")),
               ("dp_mesh_dims", True),
               ("model", ("llama", "llama_sp", "llama_lm", "tied")))),
        # any model's Linear over one sample a rank, sharded on a dp dimension of one rank: its view
        # of [1, seq, dim] as [seq, dim] fails sharding propagation ("would remove or reshape sharded
        # dimension"; the head over features, lm_head, with seq above 1)
        Shows(("raised:RuntimeError at torch/nn/modules/linear.py:forward",),
              ("large_dp_*", "losses_train_like_one_device"),
              (("entry", ("fully_shard", "replicate_fsdp", "dtensor")), ("dp_mesh_dims", True), ("dp", (1,)),
               ("local_batch", (1,)))),
    ),
    repro='f19_dtensor_spmd_programs_fail_on_cpu.py',
),
Fault(
    number=20,
    name='FSDP1 NO_SHARD cannot train a TP model',
    title="FSDP1's NO_SHARD cannot train a TP'd model",
    what="""FSDP1 with `sharding_strategy=NO_SHARD` (the ZeRO stage that shards nothing: DDP through
FSDP1's flat parameters) raises in the first forward of a model whose parameters TP made
DTensors: `RuntimeError: Cannot writeback when the parameter shape changes. Expects
torch.Size([48]) but got torch.Size([96])` (`_writeback_tensor`: the flat parameter's view
of a TP parameter is the whole tensor's size, the parameter its tp shard's; on a mesh with
one tp rank, `aten.copy_.default got mixed torch.Tensor and DTensor`). `FULL_SHARD` and
`SHARD_GRAD_OP` train the same case exactly, and `NO_SHARD` trains the same model without
TP. It is FSDP1's write-back, not the transform: the reference transform raises alike. On
one dp rank FSDP1 switches every strategy to `NO_SHARD` (with a warning), which is why TP +
FSDP1 on a (1, tp) mesh fails the same way (fault 18, and properties.md's FSDP1 findings).

- **Caught by:** `large_dp_trains_like_one_device` and `large_dp_trains_like_plain_dp`
  (`raised:RuntimeError at .../fully_sharded_data_parallel.py:summon_full_params`: the
  harness reads the parameters whole before the first forward, and FSDP1's write-back raises
  there first), under FSDP1 with `NO_SHARD`, with `auto_wrap_policy` and
  `mixed_precision` alike.""",
    consequence="""a TP model cannot be data-parallel through FSDP1 without sharding; a job
  that moves a small model from `FULL_SHARD` to `NO_SHARD` for speed stops at its first step.""",
    workaround="""`FULL_SHARD` or `SHARD_GRAD_OP`, DDP (`DistributedDataParallel(device_mesh=mesh["dp"])`),
  or FSDP2's `replicate`.""",
    fix="FULL_SHARD or SHARD_GRAD_OP, DDP, or FSDP2's replicate",
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel(sharding_strategy=NO_SHARD)',),
    source=('torch.distributed.fsdp._flat_param:FlatParamHandle._writeback_orig_params', 'torch.distributed.fsdp._flat_param:FlatParamHandle._writeback_tensor'),
    shows=(
        # NO_SHARD's write-back of a TP parameter raises (the harness reads the parameters whole first);
        # FSDP1 on one dp rank switches every strategy to NO_SHARD
        Shows(("raised:*Error at torch/distributed/fsdp/fully_sharded_data_parallel.py:summon_full_params",
               "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("fsdp1_strategy", ("NO_SHARD",)))),
        Shows(("raised:*Error at torch/distributed/fsdp/fully_sharded_data_parallel.py:summon_full_params",
               "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"),
              ("*train*", "miswiring_refused_or_exact", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("dp", (1,)))),
    ),
    repro='f20_fsdp1_no_shard_with_tp.py',
),
Fault(
    number=21,
    name='HSDP with uneven TP shards lets replicated copies drift',
    title='HSDP with uneven TP shards lets the tp copies of a replicated parameter drift apart',
    what="""`fully_shard` over `mesh["dp_replicate", "dp_shard"]` all-reduces each tp rank's flat
gradient buffer over `dp_replicate`. When TP splits a dimension unevenly (a hidden width of
7 over 2 tp ranks), the tp ranks' buffers differ in size, and a parameter TP keeps
`Replicate()` (a Rowwise layer's bias) sits at another offset in each. gloo's all-reduce
sums an element's values in an order that depends on the buffer (the same three values at
offsets 28 of 39 and 21 of 28 come back unequal in 39 of 100 draws on 4 ranks), so with 4
replicas the tp ranks get that parameter's gradient differing in the last bit. Its copies,
which DTensor's `Replicate()` promises equal, then step apart: not a value beyond its bound,
a broken invariant. With 2 replicas the sum is one addition and commutes exactly; with even
shards the buffers are alike; `fully_shard` over a 1-D dp mesh reduce-scatters instead. The
world-8 release draw found it; no 4-rank mesh has 4 replicas beside tp.

- **Caught by:** `large_dp_checkpoint_resumes` (`check:replicas-agree-on-the-saved-optimizer`
  and the loaded, resumed and uninterrupted optimizers': the momentum buffer is the
  gradient), under `fully_shard` on a 3-D mesh with uneven tp widths, at world size 8 on
  a (4, 1, 2) mesh; the same case run by `large_dp_trains_like_one_device` fails `replicas
  agree on grads` and `replicas agree on state` (its world-8 search did not draw it).""",
    consequence="""each step the tp ranks hold slightly different copies of every
  replicated parameter of an unevenly sharded model, and compute with them; a checkpoint
  saved from one tp rank is not the one the others hold, and nothing in FSDP2 brings the
  copies back together.""",
    workaround="""widths that divide by the tp degree (as torchtitan's models have), or at
  most 2 replicas on `dp_replicate`.""",
    fix='widths that divide by the tp degree, or at most 2 replicas on dp_replicate',
    entry_points=('fully_shard',),
    apis=("fully_shard(mesh=mesh['dp_replicate', 'dp_shard'])",),
    source=('torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce',),
    shows=(
        # 4 replicas sum a Replicate() parameter's gradient at another offset of each tp rank's buffer
        Shows(("check:replicas-agree-on-*",),
              ("large_dp_*",),
              (("entry", ("fully_shard",)), ("mesh_dims", (3,)), ("dp_replicate", (4, 8)), ("tp_uneven", True))),
        # FSDP2's replicate all-reduces over a 1-D dp mesh the same way: 4 replicas beside uneven tp shards
        Shows(("check:replicas-agree-on-*", "value:*"),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("replicate_fsdp",)), ("mesh_dims", (2,)), ("dp", (4, 8)), ("tp_uneven", True))),
    ),
    repro='f21_hsdp_uneven_tp_replicas_drift.py',
),
Fault(
    number=22,
    name='FSDP2 cannot reduce an empty TP shard',
    title='FSDP2 cannot reduce-scatter the gradient of a TP shard that holds no element',
    what="""When TP leaves a tp rank an empty shard (a width narrower than the tp degree: `torch.chunk`
gives the last ranks nothing), FSDP2's reduce-scatter copy-in (`foreach_reduce_scatter_copy_in`)
hands the empty gradient to `torch._chunk_cat`, which requires non-empty tensors: the
backward raises `_chunk_cat expects non-empty tensor` on that rank, under `fully_shard` and
FSDP2's `replicate` alike. TP alone trains the same model. `FSDPParam._init_sharded_param`
also turns the TP-local `[1, 0]` shard into a `(0, 0)` FSDP shard, so skipping the empty
gradient in the copy-in alone leaves `full_tensor()` hanging: a fix needs both.""",
    consequence="""a model with a layer narrower than the tp degree (a small head, a low-rank adapter, a
  tiny test model) cannot train under FSDP2 with TP.""",
    workaround="""keep every TP-sharded width at least the tp degree (better, a multiple of it), or leave
  such a layer out of the TP plan.""",
    fix="keep every TP-sharded width at least the tp degree, or leave the narrow layer out of the TP plan",
    entry_points=('fully_shard', 'replicate_fsdp'),
    apis=("fully_shard(mesh=mesh['dp'])", 'torch.distributed._composable.replicate_with_fsdp.replicate',
          'ColwiseParallel', 'RowwiseParallel'),
    source=('torch.distributed.fsdp._fully_shard._fsdp_collectives:foreach_reduce_scatter_copy_in',
            'torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharded_param'),
    shows=(
        # the backward's reduce-scatter meets the empty shard's gradient
        Shows(("raised:RuntimeError at torch/_tensor.py:backward",),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fully_shard", "replicate_fsdp")), ("tp_empty", True))),
    ),
    repro='f22_fsdp2_tp_empty_shard_reduce_scatter.py',
),
Fault(
    number=23,
    name='vocab-sharded embedding raises on an empty vocab shard',
    title='A vocab-sharded embedding raises on a tp rank that holds no row, and the others wait',
    what="""`RowwiseParallel` on an `nn.Embedding` (torchtitan's plan for the token embedding) shards
the vocab with `torch.chunk`: a vocab of 5 over 4 tp ranks leaves the last rank no row.
`_MaskPartial._mask_tensor` maps the ids a rank does not hold to row 0, even on a rank whose
table has no rows; the local `aten.embedding` there raises `index_select(): self indexing
axis dim should be positive`, while the other ranks wait for it in the all-reduce: a hang
in a user's job, or every rank failing once gloo notices. With 2 tp ranks only a vocab of 1
leaves a rank empty, and DTensor then gathers the table instead (right). The same vocab
under `loss_parallel` hangs the loss (fault 13).""",
    consequence="""a model whose vocab does not fill every tp rank hangs (or dies) in its first forward.""",
    workaround="""pad the vocab to a multiple of the tp degree, as Megatron and torchtitan do.""",
    fix="pad the vocab to a multiple of the tp degree",
    entry_points=(),
    apis=('parallelize_module', 'RowwiseParallel (on nn.Embedding)'),
    source=('torch.distributed.tensor.placement_types:_MaskPartial._mask_tensor',
            'torch.distributed.tensor._ops._embedding_ops:embedding_strategy'),
    shows=(
        # the empty vocab shard's lookup raises in the embedding's forward
        Shows(("raised:RuntimeError at torch/nn/modules/sparse.py:forward: index_select(): *",), ("*",),
              (("vocab_empty", True),)),
    ),
    repro='f23_embedding_empty_vocab_shard.py',
),
Fault(
    number=24,
    name='loss_parallel with class weights and ignored targets',
    title="Under `loss_parallel`, cross entropy with class weights cannot backpropagate past an ignored target",
    what="""`loss_parallel()`'s fused backward (`_nll_loss_and_log_softmax_backward`) gathers the class
weights by the raw target (`torch.gather(w, channel_dim, target)`) where the forward used a
safe one: a target equal to `ignore_index` (-100, the padding of a language model's labels)
is out of range, and the backward raises `index -100 is out of bounds` on every rank. The
loss itself is right; class weights without ignored targets, and ignored targets without
weights, are right. The fix is to gather with `torch.where(target != ignore_index, target, 0)`
(the result is masked afterwards).""",
    consequence="""a padded language-model loss with class weights (label re-weighting, rare-token
  up-weighting) cannot train under `loss_parallel()`.""",
    workaround="""weight the per-token losses yourself (`reduction="none"`, then multiply by the weights of
  the targets and mask the ignored ones), or compute that loss outside `loss_parallel()`.""",
    fix="weight the per-token losses yourself (reduction='none'), or compute that loss outside loss_parallel()",
    entry_points=(),
    apis=('torch.distributed.tensor.parallel.loss_parallel', 'torch.nn.functional.cross_entropy(weight=..., ignore_index=...)'),
    source=('torch.distributed.tensor.parallel.loss:_nll_loss_and_log_softmax_backward',),
    shows=(
        # the backward's gather of the weights by an ignored target
        Shows(("raised:RuntimeError at torch/_tensor.py:backward: index <n> is out of bounds*",),
              ("losses_train_like_one_device",),
              (("loss.parallel", True), ("loss.ignore_index", True), ("loss.class_weights", True))),
    ),
    repro='f24_loss_parallel_weight_ignore_index.py',
),
Fault(
    number=25,
    name='FSDP1 with TP unties tied weights',
    title='FSDP1 over a TP model unties weights the model ties',
    what="""An embedding tied to the output head (re-tied after `parallelize_module`, as users do) is
one DTensor parameter at two sites. FSDP1 with TP flattens it twice:
`FlatParamHandle._init_flat_param_and_metadata` replaces the parameter by
`DTensorExtensions.pre_flatten_transform`'s output (its local tensor) before it records it
in `shared_param_memo`, so the second site is not seen as shared. After wrapping, the two
sites are separate parameters: each gets only its own use's gradient, and they train apart.
FSDP1 without TP keeps the tie. Keying the memo by the parameter is not enough: the first
forward then raises `Changing shared parameters is not supported yet` in the extension's
write-back.""",
    consequence="""a TP model with tied weights trains as an untied one under FSDP1, silently: the
  embedding and the head drift apart from the first step.""",
    workaround="""FSDP2 (`fully_shard`) with the tie made again after `parallelize_module`, or untie the
  weights on purpose.""",
    fix="use FSDP2 (fully_shard) with the tie made after parallelize_module",
    entry_points=('fsdp1',),
    apis=("FullyShardedDataParallel(device_mesh=mesh['dp'], use_orig_params=True)", 'parallelize_module'),
    source=('torch.distributed.fsdp._flat_param:FlatParamHandle._init_flat_param_and_metadata',),
    shows=(
        # two parameters where the model has one, each trained by its own use's gradient
        Shows(("check:parameters-stay-registered-in-order", "value:*"),
              ("*train*",),
              (("entry", ("fsdp1",)), ("ties", True))),
    ),
    repro='f25_fsdp1_tp_unties_shared_weight.py',
),
Fault(
    number=26,
    name='FSDP1 cannot wrap a TP unit empty on a rank',
    title='FSDP1 with TP asserts in its constructor where a wrapped unit holds no element on a rank',
    what="""With an `auto_wrap_policy`, FSDP1 flattens each unit apart. Where TP left a rank an empty
shard of every parameter of a unit (a width narrower than the tp degree), the unit's flat
parameter has no element there, and `FlatParamHandle.shard` computes its end index as -1:
`_init_shard_metadata` asserts (`unsharded_start_idx: 0 unsharded_end_idx: -1`) in FSDP's
`__init__` on that rank, while the others go on wrapping. The same model wrapped as one
unit trains.""",
    consequence="""a TP model with a layer narrower than the tp degree cannot be wrapped per layer by
  FSDP1 (the usual policy for a transformer).""",
    workaround="""keep every TP-sharded width at least the tp degree, wrap such a layer in a larger unit,
  or use FSDP2.""",
    fix="keep every TP-sharded width at least the tp degree, or wrap the narrow layer in a larger unit",
    entry_points=('fsdp1',),
    apis=('FullyShardedDataParallel(auto_wrap_policy=..., device_mesh=...)',),
    source=('torch.distributed.fsdp._flat_param:FlatParamHandle.shard',
            'torch.distributed.fsdp._flat_param:FlatParamHandle._init_shard_metadata'),
    shows=(
        # the empty unit's shard metadata asserts in the constructor
        Shows(("raised:AssertionError at torch/distributed/fsdp/fully_sharded_data_parallel.py:__init__",),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fsdp1",)), ("tp_empty", True))),
    ),
    repro='f26_fsdp1_tp_empty_unit_assert.py',
),
Fault(
    number=27,
    name="FSDP2's local shards contradict an uneven TP layout",
    title="Under FSDP2, an unevenly TP-sharded parameter's local shards are not where its placements say",
    what="""`fully_shard` on `mesh["dp"]` shards a parameter TP already sharded on dim 0 (a
`ColwiseParallel` weight) once more on dim 0: its placements become `(_StridedShard(0, sf=tp),
Shard(0))`. Where TP's split is uneven (a width that does not divide by the tp degree), the
rows each rank holds disagree with the shape and offset those placements give
(`compute_local_shape_and_global_offset`): on a (3, 2) mesh, rank 4 holds no row of a width
of 7 and rank 5 holds row 6, where the layout says the reverse (on (4, 2), widths 9, 17, 25;
with 2 dp ranks no width shows it). FSDP2 stores each rank's piece as a chunk of its TP shard
(`_init_sharded_param`) and labels it `(_StridedShard(0, sf=tp), Shard(0))`
(`_init_sharding_spec_tp`), which DTensor splits otherwise. `full_tensor()` is still right;
anything that trusts the layout (DCP's offsets, a reader assembling the shards, the gate's
harness) puts rows in the wrong place.""",
    consequence="""checkpoints and tools that place local shards by their layout misplace rows of an
  unevenly sharded model under FSDP2 with TP.""",
    workaround="""widths that divide by the tp degree (as torchtitan's models have); read parameters
  through `full_tensor()`.""",
    fix="keep TP-sharded widths divisible by the tp degree; read parameters through full_tensor()",
    entry_points=('fully_shard',),
    apis=("fully_shard(mesh=mesh['dp'])", 'ColwiseParallel', 'torch.distributed.checkpoint'),
    source=('torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharded_param',
            'torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharding_spec_tp'),
    shows=(
        # the ranks' shards, assembled by their layout, disagree across replicas and with one device;
        # 3 or more dp ranks (with 2, every uneven width's rows land where the layout says)
        Shows(("check:replicas-agree-on-*", "value:*", "check:every-optimizer-state-is-there",
               "check:trainable-parameters-move-as-in-the-oracle"),
              ("*train*", "*state_dict_like_unsharded", "*checkpoint_resume*"),
              (("entry", ("fully_shard",)), ("mesh_dims", (2,)), ("dp", (3, 4, 5, 6, 7, 8)), ("dp_mesh_dims", False),
               ("tp_uneven", True))),
    ),
    repro='f27_fsdp2_uneven_tp_local_shard_layout.py',
),
Fault(
    number=28,
    name='loss_parallel over (N, C, H, W) logits',
    title='Under `loss_parallel`, cross entropy over (N, C, H, W) logits gives a wrong gradient or raises',
    what="""`loss_parallel()`'s backward of `nll_loss2d` (`_nll_loss_and_log_softmax_backward`, the branch
for logits of more than two dims) lays the gradient out by `grad_input.transpose(1, -1)`, as
(N, W, H, C), and puts each position's -1 at the row of the target flattened in (N, H, W)
order: with H and W both above 1 the -1s land on the wrong positions. It also returns that
transposed local tensor in a DTensor whose spec declares contiguous strides. Logits that are a
leaf get a wrong gradient, silently (reduction sum, mean or none, with class weights or not);
logits made by a view, as a head's `[tokens, vocab]` output laid out `(1, vocab, H, W)` by
`transpose` and `unflatten`, raise `view size is not compatible with input tensor's size and
stride` in the view's backward. The loss itself is right; (N, C, D) logits, which ATen takes
as (N, C, 1, D), are right too.""",
    consequence="""a per-pixel classifier (segmentation) trained with a vocab-sharded head under
  `loss_parallel()` gets wrong gradients, or its backward raises.""",
    workaround="""flatten the spatial dims before the loss: `F.cross_entropy(logits.flatten(2), target.flatten(1))`
  takes the (N, C, D) path, whose gradients match one device's (the reproduction checks it).""",
    fix="flatten the spatial dims before the loss: cross_entropy(logits.flatten(2), target.flatten(1))",
    entry_points=(),
    apis=('torch.distributed.tensor.parallel.loss_parallel', 'torch.nn.functional.cross_entropy'),
    source=('torch.distributed.tensor.parallel.loss:_nll_loss_and_log_softmax_backward',
            'torch.distributed.tensor.parallel.loss:_nll_loss_backward_handler'),
    shows=(
        # the logits' (1, vocab, H, W) view: its backward meets the handler's transposed gradient
        Shows(("raised:RuntimeError at torch/_tensor.py:backward: view size is not compatible*",),
              ("losses_train_like_one_device",),
              (("loss.parallel", True), ("loss.logits", ("nchw",)))),
    ),
    repro='f28_loss_parallel_nchw_logits_backward.py',
),
Fault(
    number=29,
    name='max-norm clipping with an empty FSDP2 shard',
    title='`clip_grad_norm_(norm_type=inf)` raises on a rank whose FSDP2 shard is empty, and the others wait',
    what="""`fully_shard` splits a parameter's dim 0 as `torch.chunk` does, so a dim smaller than the dp
degree leaves the last dp ranks an empty shard. For the inf (and -inf) norm, DTensor computes
each local shard's norm and marks it `Partial("max")` (`_get_norm_reduction_op`): on an empty
shard the local `aten._foreach_norm` (`linalg.vector_norm` with `foreach=False`) raises
`cannot compute the infinity norm on an empty tensor`, in `_get_total_norm`, while the ranks
holding data go on into `_clip_grads_with_norm_`'s all-reduce and wait: a hang in a user's
job. The 2-norm and the 1-norm are right (`_NormPartial` gives an empty shard 0). Neither TP
nor FSDP is needed: any DTensor with an empty `Shard` raises so.""",
    consequence="""a model with a parameter dim smaller than the dp degree (a bias of 1, a tiny head)
  cannot clip by the max norm under FSDP2: one rank raises, the others hang.""",
    workaround="""take the max of `p.grad.to_local().abs().max()` over the non-empty local shards (from 0),
  `all_reduce` it with `MAX`, then `torch.nn.utils.clip_grads_with_norm_`; or keep each
  FSDP-sharded dim 0 a multiple of the dp degree.""",
    fix="all_reduce(MAX) the max |grad| of the non-empty local shards, then clip_grads_with_norm_",
    entry_points=('fully_shard', 'replicate_fsdp'),
    apis=('torch.nn.utils.clip_grad_norm_(norm_type=inf)', 'torch.nn.utils.get_total_norm',
          "fully_shard(mesh=mesh['dp'])"),
    source=('torch.distributed.tensor._ops._math_ops:_get_norm_reduction_op',
            'torch.distributed.tensor._ops._math_ops:foreach_norm_strategy',
            'torch.distributed.tensor._ops._math_ops:vector_norm_strategy'),
    shows=(
        # the local max of an empty shard, in either way of clipping (the entry points' cover cases)
        Shows(("raised:RuntimeError at torch/nn/utils/clip_grad.py:clip_grad_norm_: *cannot compute the inf* norm on an empty tensor*",
               "raised:RuntimeError at torch/nn/utils/clip_grad.py:_get_total_norm: *cannot compute the inf* norm on an empty tensor*"),
              ("*train*",),
              (("entry", ("fully_shard", "replicate_fsdp")), ("habits.norm_type", ("inf",)))),
    ),
    repro='f29_fsdp2_inf_norm_empty_shard.py',
    upstream=('https://github.com/pytorch/pytorch/pull/173238',),
),
Fault(
    number=30,
    name='the max norm read per rank',
    title="`clip_grad_norm_(norm_type=inf)` over DTensor gradients returns a norm whose `.item()` is each rank's own",
    what="""For the inf norm DTensor marks each shard's norm `Partial("max")` (`_get_norm_reduction_op`), and
the max over the stacked norms that `_get_total_norm` takes next stays `Partial("max")`: with
gradients sharded over ranks (FSDP2's dp shards), `clip_grad_norm_` and `get_total_norm`
return a DTensor that was never reduced. The clipping is right (the clip coefficient's
division reduces it), but `.item()`, as a user logs the norm or compares it with a
threshold to skip a step, is the max over the rank's own shards: each rank reads another
number, and only the rank holding the largest entry reads the total. The 2-norm and the
1-norm come back `Replicate`. The fault needs neither TP nor FSDP2 (any DTensor gradient
sharded over ranks returns it so); the suite meets it through `fully_shard` over dp.""",
    consequence="""a logged max norm differs by rank and is too small on most; a step skipped on it is
  skipped on some ranks only, and their models part (or the next collective hangs).""",
    workaround="""read the norm whole: `norm.full_tensor().item()` (torchtitan's `clip_grad_norm_` does), or
  `redistribute` it to `Replicate()` before `.item()`.""",
    fix="read the norm whole: norm.full_tensor().item()",
    entry_points=('fully_shard',),
    apis=('torch.nn.utils.clip_grad_norm_(norm_type=inf)', 'torch.nn.utils.get_total_norm(norm_type=inf)',
          "fully_shard(mesh=mesh['dp'])"),
    source=('torch.distributed.tensor._ops._math_ops:_get_norm_reduction_op',
            'torch.nn.utils.clip_grad:_get_total_norm'),
    shows=(
        # the norm clip_grad_norm_ returns, read with .item() (the harness reads get_total_norm's
        # whole, as torchtitan does); the cover cases clip MLP through fully_shard over dp alone
        Shows(("value:gradient-norm",), ("*train*",),
              (("entry", ("fully_shard",)), ("habits.norm_type", ("inf",)), ("habits.clip_by", ("clip_grad_norm_",)))),
    ),
    repro='f30_max_norm_read_per_rank.py',
),
Fault(
    number=31,
    name="a batch mean of cross entropy over DTensors averages the ranks' means",
    title="Cross entropy's mean over logits sharded on the batch is the mean of each rank's mean: wrong, or nan, where ranks count their targets differently",
    what="""With the batch a DTensor sharded over dp (the SPMD form: `fully_shard` over the whole mesh, or
DTensor's program with no wrapper), `F.cross_entropy(logits, target, reduction="mean")` and
`F.nll_loss` over the whole batch go through DTensor's `nll_loss_forward_strategy`, which makes the
loss `Partial("avg")` of each rank's local mean. Each local mean divides by that rank's own total
weight: its count of targets not ignored (`ignore_index`), or the sum of its targets' class
weights. The mean of the ranks' means is the batch's mean only where every rank's total weight is
the same (the strategy's check, `is_tensor_evenly_shardable`, looks at shapes only). With ignored
targets spread unevenly over the ranks, or with class weights, the loss is wrong; where a rank's
targets are all ignored (padding), its mean is 0/0 and the loss is nan on every rank. The
gradients are right: the backward divides by the summed total weight. `loss_parallel()` refuses a
mean on a mesh of two dims instead.

- **Caught by:** `losses_train_like_one_device` (`value:loss`), with the loss taken over the batch
  (`Loss.over`) in the SPMD form, without `loss_parallel()`.""",
    consequence="""the logged loss of a model trained with padded batches or class weights is wrong, and nan
  whenever one dp rank's samples are all padding: a loop that skips a step on a nan loss, stops
  early or schedules on the loss acts on a number one device never computes.""",
    workaround="""take the sum and divide by the global total weight: `F.cross_entropy(..., reduction="sum") /
  (target != ignore_index).sum()` (with class weights, `/ weight[target[target != ignore_index]].sum()`),
  both DTensor reductions over dp, as loss_parallel's docs advise.""",
    fix="reduction='sum', divided by the global count of targets not ignored (a DTensor sum)",
    entry_points=('dtensor', 'fully_shard', 'replicate_fsdp'),
    apis=('torch.nn.functional.cross_entropy(reduction="mean")', 'torch.nn.functional.nll_loss(reduction="mean")',
          'DTensor'),
    source=('torch.distributed.tensor._ops._math_ops:nll_loss_forward_strategy',),
    shows=(
        # the loss over the batch's ignored targets, spread unevenly over the dp ranks; or with class weights
        *(Shows(("value:loss",), ("losses_train_like_one_device",),
                (("loss.over", ("batch",)), ("loss.parallel", False), ("loss.reduction", ("mean",)),
                 ("loss.kind", ("cross_entropy", "z_loss", "expected_cost", "nll")), (uneven, True),
                 ("dp", (2, 3, 4, 5, 6, 7, 8))))
          for uneven in ("loss.ignore_index", "loss.class_weights")),
    ),
    repro='f31_dtensor_batch_mean_of_means.py',
),
Fault(
    number=32,
    name='loss_parallel left on after an exception',
    title='An exception inside `loss_parallel()` leaves its loss handlers on for the rest of the process',
    what="""`loss_parallel` is a generator context manager that calls `_enable_custom_loss_ops()`, yields,
then `_disable_custom_loss_ops()`, with no `try`/`finally`. When its body raises (a batch that fails,
a loss torch refuses, such as a mean on a mesh of two dims, an interrupt a training loop catches to
skip a step), the parallel handlers of `_log_softmax` and `nll_loss` stay registered in DTensor's
dispatcher. Every later cross entropy over a DTensor in that process, outside any
`loss_parallel()`, goes through them: over replicated logits (an evaluation loop's) it raises
`loss_parallel() requires exactly one mesh dim to shard tensor dimension 1`.

- **Caught by:** its reproduction alone. The gate's ranks take many cases, so the training loop
  puts DTensor's table back after its `loss_parallel()` block (tpdp_verify/ranks/loop.py), and
  each call reports what it left changed of torch's process-wide state, DTensor's custom op
  handlers among it: ranks so left are replaced before the next case, so that no case depends on
  the ones before it (tpdp_verify/ranks/pool.py; tests/test_pool.py shows the table left changed).""",
    consequence="""a training loop that survives an exception in its loss step (a skipped batch, a retried
  step) computes every later DTensor loss with the parallel handlers: evaluation over replicated
  logits raises, and a loss over sharded logits meant to be gathered goes through loss_parallel's
  code.""",
    workaround="""enter `loss_parallel()` around the loss and its backward only, and where the block may
  raise, call `torch.distributed.tensor.parallel.loss._disable_custom_loss_ops()` in a `finally`.""",
    fix="keep loss_parallel() around the loss and backward only; disable its ops in a finally where the block may raise",
    entry_points=(),
    apis=('torch.distributed.tensor.parallel.loss_parallel',),
    source=('torch.distributed.tensor.parallel.loss:loss_parallel',),
    shows=(),
    repro='f32_loss_parallel_left_on_after_an_exception.py',
),
Fault(
    number=33,
    name='DDP with TP refuses a DTensor buffer',
    title='DDP with TP cannot wrap a model that holds a DTensor buffer',
    what="""A TP model whose buffer is a DTensor replicated over tp (torchtitan holds its RoPE cache so)
cannot be wrapped by `DistributedDataParallel(model, device_mesh=mesh["dp"])` or by DDP after
`_pre_dp_module_transform`: the transform turns the DTensor parameters into local tensors for
DDP, but not the buffers, and DDP's initial sync of the module's states (`_sync_module_states`)
broadcasts the DTensor (`Operator c10d.broadcast_.default does not have a sharding strategy
registered`) or coalesces it with plain tensors (`aten.cat.default got mixed torch.Tensor and
DTensor`); with `init_sync=False`, its first forward's sync of the buffers broadcasts it. The
same model with plain buffers wraps; FSDP1 and FSDP2 take the DTensor buffer.

- **Caught by:** the training and checkpoint properties (`raised:RuntimeError` or
  `raised:NotImplementedError at torch/nn/parallel/distributed.py:__init__`), on the `buffers`
  model holding its buffers as DTensors (`Habits.buffers`).""",
    consequence="""a model that keeps its rotary cache or other buffers as DTensors (torchtitan's Llama) cannot
  be trained with DDP and TP.""",
    workaround="""keep the buffers plain local tensors (`buffer.to_local()`, replicated: the whole value)
  before wrapping, or tell DDP to leave them out
  (`DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)`), or use FSDP2.""",
    fix="make DTensor buffers plain (to_local) before wrapping with DDP, or use FSDP2",
    entry_points=('transform_ddp', 'ddp_mesh'),
    apis=('DistributedDataParallel(device_mesh=...)', 'torch.distributed.tensor.parallel.ddp._pre_dp_module_transform'),
    source=('torch.distributed.tensor.parallel.ddp:_pre_dp_module_transform',
            'torch.distributed.utils:_sync_module_states'),
    shows=(
        # DDP's initial sync of the module's states meets the DTensor buffers
        Shows(("raised:NotImplementedError at torch/nn/parallel/distributed.py:__init__: Operator c10d.broadcast_*",
               "raised:RuntimeError at torch/nn/parallel/distributed.py:__init__: aten.cat.default got mixed*",
               # ... or, with init_sync=False, its first forward's sync of the buffers
               "raised:NotImplementedError at torch/nn/parallel/distributed.py:forward: Operator c10d.broadcast_*"),
              ("*",),
              (("entry", ("transform_ddp", "ddp_mesh")), ("habits.buffers", ("dtensor",)))),
        # a user's model (tpdp-verify plan) whose buffers are DTensors, torchtitan's Llama's: DDP's
        # sync broadcasts one DTensor (a coalesced sync mixing DTensors is fault 3's tied copies too)
        Shows(("raised:NotImplementedError at torch/nn/parallel/distributed.py:__init__: Operator c10d.broadcast_*",
               "raised:NotImplementedError at torch/nn/parallel/distributed.py:forward: Operator c10d.broadcast_*"),
              ("*",), (("entry", ("transform_ddp", "ddp_mesh")), ("user", True))),
    ),
    repro='f33_ddp_tp_dtensor_buffer.py',
),
Fault(
    number=34,
    name='a nested uneven shard gathered over a flattened mesh',
    title="A dim sharded over two mesh dims unevenly gathers wrong once those dims' flattened submesh exists",
    what="""A DTensor that shards one dim over two or more mesh dims, `(Shard(d), Shard(d))`, where the dim
does not divide by their product, is each rank's chunk of a chunk. Gathered back (`full_tensor()`,
`redistribute` to `Replicate()`, a full state_dict through `get_model_state_dict`) it is right,
until the submesh of those mesh dims has been flattened. HSDP's and `fully_shard(mesh,
dp_mesh_dims=...)`'s two dp dims are flattened for them, as any flattened dp group is. Then
`_optimize_transform_infos` merges the consecutive all-gathers into one over the flattened mesh,
padded and unpadded as one `Shard(d)` over all those ranks, whose chunk sizes are not the nested
ones. Where they differ, the values come back misplaced, with zeros where a rank's padding was
(not every uneven dim: the ci draw holds uneven ones it reads back exactly). It checks that a
merged reduce-scatter divides evenly; it does not check a merged all-gather. Without the flattened
submesh torch warns that the gathers run one by one, and says to flatten the mesh dims to make it
one: the step that brings the fault in.

- **Caught by:** `nested_shards_read_back` (`full_tensor() gives t`, `redistribute to Replicate()
  gives t`, `a full state_dict gives t`, and a redistribute that replicates one of the nested
  mesh dims), on a mesh whose flattened submesh holds the nested dims. And in training: the SPMD
  form's batch over two dp dims that it does not divide (`TrainCase.batch_short`), the flattened
  dp submesh built beside them, gives a wrong mean loss (`value:loss`; its gradients are right,
  and so is the sum) in `entry_points_train_like_one_device`.""",
    consequence="""a batch, activation or parameter sharded over HSDP's or the SPMD form's two dp dims, with a
  dim that does not divide over both, can read back wrong on every rank: the logits a user gathers to
  log or evaluate, and the full state_dict a checkpoint saves, hold zeros and rows moved from where
  they belong, with no error.""",
    workaround="""keep such dims divisible by the product of the mesh dims that shard them (pad the batch), or
  gather one mesh dim at a time: `t.redistribute(mesh, (Shard(d), Replicate()))` then
  `(Replicate(), Replicate())`, or `t.full_tensor()` on a mesh whose dims were never flattened.""",
    fix="keep a dim sharded over two mesh dims divisible by their product, or redistribute one mesh dim at a time",
    entry_points=(),
    apis=('DTensor.full_tensor', 'DTensor.redistribute',
          'torch.distributed.checkpoint.state_dict.get_model_state_dict', 'DeviceMesh._flatten'),
    source=('torch.distributed.tensor._redistribute:_optimize_transform_infos',),
    shows=(
        # the merged all-gather, wherever one reads back a dim sharded over the flattened mesh dims
        Shows(("check:full_tensor-gives-t", "check:redistribute-to-replicate-gives-t",
               "check:redistribute-replicating-mesh-dim-*-gives-its-blocks", "check:a-full-state_dict-gives-t"),
              ("nested_shards_read_back",),
              (("flattened", True), ("nested_unevenly", True))),
        # the mean of a batch sharded so, which gathers it
        Shows(("value:loss",), ("*train*",), (("flattened", True), ("nested_unevenly", True))),
    ),
    repro='f34_nested_uneven_gather_over_flattened_mesh.py',
),
Fault(
    number=35,
    name='DCP saves a per-part shard as one chunk',
    title="DCP refuses to save a fused projection sharded per part over tp: each rank's blocks become one chunk, and the chunks overlap",
    what="""A fused projection (qkv, gate_up: parts of rows concatenated) sharded per part over tp by public
DTensor calls, the weight viewed `(parts, rows, cols)`, `distribute_tensor` on `Shard(1)`, then
flattened back, holds a block of every part on each rank (`_StridedShard(0, split_factor=parts)`),
and `full_tensor()` gives it back. `torch.distributed.checkpoint.save` describes each rank's shard
by one chunk (`DTensor.__create_chunk_list__`, `_create_chunk_from_dtensor`, from
`compute_local_shape_and_global_offset`): a contiguous run of rows where the rank holds several
blocks apart. The chunks then overlap, and the save is refused: `Failed to validate global plan:
key:... has overlapping chunks`. With FSDP2 over dp on top, its state_dict's DTensors are refused
alike. The same weight sharded contiguously (`Shard(0)`) saves and loads.

- **Caught by:** `fused_projections_read_back` (`DCP saves it`: the `CheckpointException`), and
  `checkpoint_resumes`' cover case of the zoo's fused model through `fully_shard` by DCP.""",
    consequence="""a model with fused qkv or gate_up projections sharded per part over tp cannot be
  checkpointed with DCP: the save raises on every rank.""",
    workaround="""gather the fused weight before saving (`full_tensor()`, or `get_model_state_dict(...,
  full_state_dict=True)` and `torch.save`), or keep the parts as separate parameters, each
  sharded contiguously.""",
    fix="save full tensors (full_state_dict=True) for fused projections, or keep the parts separate parameters",
    entry_points=('fully_shard',),
    apis=('torch.distributed.checkpoint.save', 'DTensor.__create_chunk_list__'),
    source=('torch.distributed.checkpoint.planner_helpers:_create_chunk_from_dtensor',
            'torch.distributed.tensor._api:DTensor.__create_chunk_list__'),
    shows=(
        # a per-part layout's save, with FSDP2 over dp or not
        Shows(("raised:CheckpointException at torch/distributed/checkpoint/utils.py:inner_func*",),
              ("fused_projections_read_back",), (("parts", (2, 3)),)),
        # the zoo's fused model checkpointed by DCP through fully_shard
        Shows(("raised:CheckpointException at torch/distributed/checkpoint/utils.py:inner_func*",),
              ("*checkpoint*",), (("per_part", True), ("route", ("dcp",)))),
    ),
    repro='f35_dcp_saves_a_per_part_shard_as_one_chunk.py',
),
Fault(
    number=36,
    name='FSDP2 over a per-part tp shard',
    title="fully_shard over a fused projection sharded per part on tp: full_tensor() and the state_dict hold its rows out of place",
    what="""A fused projection sharded per part over tp (`_StridedShard(0, split_factor=parts)`, as the
public view route makes it) reads back right. `fully_shard` over dp then gives the parameter the
placements `(_StridedShard(0, split_factor=tp), _StridedShard(0, split_factor=parts))`:
`FSDPParam._init_sharding_spec_tp` strides its dp shard by the number of tp shards, as for a
contiguous `Shard(0)` on tp, and the layout it declares is not the one the ranks hold.
`full_tensor()`, and so every full state_dict and gathered checkpoint, hold the rows out of
place, as does a gradient's `full_tensor()`. Training runs on the gathered local shards: the zoo's
fused model through `fully_shard` over 2 dp ranks gives one device's outputs at every step while
its weights, gradients and optimizer state, read whole, depart.

- **Caught by:** `fused_projections_read_back` (`full_tensor() gives w`, `a full state_dict gives w`)
  with FSDP2 over dp; `entry_points_train_like_one_device`'s fused cover cases through
  `fully_shard` (every value read whole of `w13`), and `state_dict_like_unsharded`'s (its
  state_dict's values).""",
    consequence="""a model with fused projections sharded per part over tp and wrapped with FSDP2: every full
  state_dict, `full_tensor()` and export of its fused weights holds their rows out of place, with
  no error; a checkpoint loaded on one device is a different model.""",
    workaround="""keep the parts as separate parameters, each sharded contiguously (`ColwiseParallel`), or
  shard the fused weight contiguously and reorder its rows so that each rank's contiguous block
  holds its block of each part.""",
    fix="keep fused parts as separate parameters under FSDP2 + TP",
    entry_points=('fully_shard',),
    apis=('torch.distributed.fsdp.fully_shard', 'DTensor.full_tensor'),
    source=('torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharding_spec_tp',),
    shows=(
        Shows(("check:full_tensor-gives-w", "check:a-full-state_dict-gives-w"),
              ("fused_projections_read_back",), (("parts", (2, 3)), ("fsdp", True))),
        # the zoo's fused model trained through fully_shard: its weights and gradients read whole
        Shows(("value:*",), ("*train*",), (("per_part", True), ("dp_sharded", True))),
        # and its state_dict
        Shows(("check:state_dict-*-holds-the-unsharded-model-s-values",), ("*state_dict*",),
              (("per_part", True), ("dp_sharded", True))),
    ),
    repro='f36_fsdp2_over_a_per_part_tp_shard.py',
),
Fault(
    number=37,
    name='per-part view of one-row parts',
    title="A fused weight of one-row, one-column parts, sharded per part over tp by DTensor's view, gets shards of the wrong shape",
    what="""Sharding a fused projection per part over tp by public DTensor calls (the weight viewed
`(parts, rows, cols)`, `distribute_tensor` on `Shard(1)`, flattened back) is right for any number
of rows per part but one. With parts of one row, a rank past the row should hold a `(0, cols)`
shard; with one column the flatten's sharding propagation (`_view_ops`) gives it a
`(parts, 0)` one, so the DTensor's shards do not tile its shape, and FSDP2's gathers over it
hang; with more columns the view is refused (the exclusion `fused_parts_of_one_row`).

- **Caught by:** `fused_projections_read_back` (`the shard holds a block of each part`), on parts of
  one row and one column.""",
    consequence="""a fused weight whose parts are single rows (a per-head scalar, a one-wide gate) sharded
  per part over tp holds shards that contradict its layout: `full_tensor()`, FSDP2 and
  checkpoints over it hang or read wrong.""",
    workaround="""shard such a weight contiguously (`Shard(0)`) or replicate it: parts of one row have
  nothing to split per part.""",
    fix="replicate or shard contiguously a fused weight whose parts are one row",
    entry_points=(),
    apis=('DTensor.flatten', 'DTensor.view'),
    source=('torch.distributed.tensor._ops._view_ops:propagate_shape_and_sharding',),
    shows=(
        Shows(("check:the-shard-holds-a-block-of-each-part",), ("fused_projections_read_back",),
              (("rows", (1,)), ("cols", (1,)))),
    ),
    repro='f37_view_of_parts_of_one_row.py',
),
Fault(
    number=38,
    name='vocab-sharded embedding output reduced once',
    title="The output of a vocab-sharded embedding can be reduced once: a program that uses it twice raises",
    what="""An embedding whose weight is sharded on the vocabulary (`Shard(0)`, a vocab-parallel input
embedding) leaves its output `_MaskPartial`: each rank's partial lookup, with the mask of the rows it
looked up waiting in a `MaskBuffer` for the reduction. `_MaskPartial._reduce_value` applies the mask,
releases the buffer and all-reduces, so the output can be reduced once. A program that uses it
twice before reducing it, as an RMSNorm of the embedding does (`x * rsqrt(mean(x ** 2))`), reduces
it twice, and the second finds no mask: a bare `AssertionError` in `_reduce_value`.

- **Caught by:** the transformers conformance table (docs/transformers-conformance.md): Inkling's and
  MuseGlimmer's normed embeddings (an `nn.Embedding` whose forward applies its norm) under
  transformers' own TP, which shards every input embedding on the vocabulary; and its
  reproduction.""",
    consequence="""a model that normalizes, scales twice or adds its embedding to itself before anything
  reduces it cannot run with a vocab-sharded embedding: its forward raises an AssertionError with
  no message.""",
    workaround="""reduce the embedding's output before its second use: `x.redistribute(placements=[Replicate()])`
  (or `full_tensor()`) right after the lookup, as `RowwiseParallel`'s output layouts do.""",
    fix="redistribute a vocab-sharded embedding's output to Replicate() before using it twice",
    entry_points=(),
    apis=('torch.nn.functional.embedding', 'DTensor.redistribute'),
    source=('torch.distributed.tensor.placement_types:_MaskPartial._reduce_value',),
    shows=(),
    repro='f38_mask_partial_reduced_once.py',
),
Fault(
    number=39,
    name="an in-place step on a shard of fewer rows than ranks",
    title="The optimizer's in-place step raises on a DTensor parameter sharded over more ranks than its dim has rows",
    what="""A parameter sharded `Shard(d)` over a mesh dim of more ranks than dim `d` has rows (TP over 4
ranks of a width of 2 or 3) runs its forward and backward, and its gradient has its placements.
The optimizer's step then raises on every rank: SGD's `param.add_(grad)`, Adam's
`exp_avg.lerp_(grad)` and the other updates are in-place pointwise ops, and
`expand_to_full_mesh_op_strategy` drops every strategy whose inputs `is_tensor_shardable` calls
unshardable (a dim smaller than the number of shards), the one that keeps `Shard(d)` among them;
an in-place op cannot change its input's placement, so it raises "in-place operations that require
placement changes are not supported". Where the dim has as many rows as ranks or more, torch.chunk
leaving a rank none (5 rows over 4) included, it steps.

- **Caught by:** the training properties at world size 8 (the release draw: TP over 4 ranks of
  the zoo's widths of 2 and 3, through DTensor's own program, FSDP2 and FSDP1), and its
  reproduction.""",
    consequence="""a model whose TP'd width is below the tp degree (few heads or experts over many ranks, a
  tiny vocabulary) trains forward and backward and cannot take one optimizer step: every rank
  raises at `optimizer.step()`.""",
    workaround="""keep every sharded width at least the tp degree, or leave the narrow parameters out of the
  plan (replicated over tp).""",
    fix="keep each TP'd width at least the tp degree, or leave the narrow parameters replicated",
    entry_points=(),
    apis=('torch.optim.Optimizer.step', 'DTensor'),
    source=('torch.distributed.tensor._ops.utils:expand_to_full_mesh_op_strategy',
            'torch.distributed.tensor._ops.utils:is_tensor_shardable'),
    shows=(
        Shows(("raised:RuntimeError at torch/optim/optimizer.py:_use_grad: *in-place operations that require "
               "placement changes are not supported*",), ("*train*",), (("tp_narrow", True),)),
    ),
    repro='f39_inplace_step_on_fewer_rows_than_ranks.py',
),
Fault(
    number=40,
    name="DCP loads a per-part shard at the wrong rows",
    title="DCP loads a checkpoint onto a fused projection sharded per part over tp at the wrong rows, silently",
    what="""A fused projection sharded per part over tp (`_StridedShard(0, split_factor=parts)`, as the
public view route makes it: fault 35's layout) is the target of a DCP load, of a checkpoint
saved from a layout DCP saves (contiguous `Shard(0)`, another job's or another mesh's). The
load raises nothing and leaves wrong rows: it plans its reads from the chunks the target's
DTensors describe, and `DTensor.__create_chunk_list__` (`_create_chunk_from_dtensor`, from
`compute_local_shape_and_global_offset`) describes each rank's blocks as one contiguous run of
rows at its first block's offset. Each rank reads the rows that follow its block of the first
part where its block of the next part belongs. Fault 35's chunks, met on the load, where no
validation refuses them. With FSDP2 over dp on top, and onto a mesh of another shape, alike;
the same checkpoint loads right onto a contiguous layout.

- **Caught by:** `fused_projections_read_back` (`DCP loads w saved contiguously onto its own
  layout` and `onto a mesh of every rank on tp`: the values).""",
    consequence="""a model with fused qkv or gate_up projections sharded per part over tp, loaded from a
  DCP checkpoint (a pretrained model's, a resharded resume's), trains from wrong weights with no
  error: rows of one part sit in another's place.""",
    workaround="""load into a contiguous layout (or full tensors) and distribute per part from there
  (`distribute_tensor` of the loaded weight viewed `(parts, rows, cols)` on `Shard(1)`), or keep the
  parts as separate parameters, each sharded contiguously.""",
    fix=("load fused projections into full or contiguous tensors and shard per part after, or keep the parts "
         "separate parameters"),
    entry_points=('fully_shard',),
    apis=('torch.distributed.checkpoint.load', 'DTensor.__create_chunk_list__'),
    source=('torch.distributed.checkpoint.planner_helpers:_create_chunk_from_dtensor',
            'torch.distributed.tensor._api:DTensor.__create_chunk_list__'),
    shows=(
        # a checkpoint DCP could save, loaded onto the per-part layouts, with FSDP2 over dp or not
        Shows(("check:dcp-loads-w-saved-contiguously-onto-*",), ("fused_projections_read_back",),
              (("parts", (2, 3)),)),
    ),
    repro='f40_dcp_loads_a_per_part_shard_at_the_wrong_rows.py',
),
Fault(
    number=41,
    name="index_put's backward mixes in a plain tensor",
    title="The backward of a masked assignment (`y[mask] = v`) on DTensors raises: it mixes in a plain tensor",
    what="""A masked assignment `y[mask] = values` (an `index_put_`) on DTensors runs forward and records
`IndexPutBackward0`. Autograd's generated node keeps only the shape and options of `values`
(`TypeAndSize values_info`) and computes the gradient of `y` as
`grad.index_put(indices, values_info.zeros(), accumulate)`: `values_info.zeros()` is a plain
tensor whatever `values` was, so with a DTensor gradient DTensor's dispatch refuses the mix
(`aten.index_put.default got mixed torch.Tensor and DTensor`), though every tensor of the program
is a DTensor, whatever the placements. The same program on plain tensors steps, and so does the
DTensor program written with `torch.where`.

- **Caught by:** the transformers conformance table (docs/transformers-conformance.md): T5Gemma 2's
  text encoder and decoder under transformers' own TP, which shards their scaled word embedding
  (`embedding_rowwise`), whose forward writes its end-of-image embedding so (the backward raises
  even where no token is that one); and its reproduction.""",
    consequence="""a model that writes into a tensor by a mask (special-token embeddings, masked fills by
  assignment) cannot train where that tensor is a DTensor: its backward raises.""",
    workaround="""write it out of place: `torch.where(mask[..., None], values, y)` in place of `y[mask] = values`
  (or reduce `y` to a plain tensor before the assignment).""",
    fix="write by torch.where in place of a masked assignment on DTensors",
    entry_points=(),
    apis=('torch.Tensor.__setitem__', 'torch.Tensor.index_put_'),
    # the refusal; the formula that hands it a plain tensor is C++ (derivatives.yaml, index_put: values_info.zeros())
    source=('torch.distributed.tensor._dispatch:OpDispatcher._try_replicate_spec_for_scalar_tensor',),
    shows=(),
    repro='f41_index_put_backward_mixes_a_plain_tensor.py',
    upstream=('https://github.com/pytorch/pytorch/issues/118461',),
),
Fault(
    number=42,
    name="fully_shard's SPMD form refuses an equal mesh",
    title="After TP under FSDP2 in a process, `fully_shard`'s SPMD form refuses parameters made on the very mesh it is given",
    what="""`fully_shard(model, mesh=mesh, dp_mesh_dims=...)` (and the FSDP2-based `replicate`) requires each
parameter's DTensor mesh to be `mesh` itself: `_init_sharding_spec_spmd` compares them by identity
(`spmd_mesh is not self.mesh_info.spmd_mesh`). DTensor treats equal meshes as one: its sharding
propagation caches each op's output spec, mesh object included, under a key that compares meshes by
value, and hands that spec to the next op on an equal mesh. TP under FSDP2 on a dp submesh (FSDP2's
TP path; its `replicate` here) builds, for each parameter, a new mesh equal to the whole one
(`DeviceMesh._concatenate`) and makes the parameter there (`nn.Parameter`, a `detach`), replicated
over dp and sharded over tp. Afterwards, in the same process,
`nn.Parameter(distribute_tensor(w, mesh, [Replicate(), Shard(0)]))` on the whole mesh returns a
DTensor that holds that earlier mesh, and `fully_shard` raises `Expected param's DTensor mesh to be
the same mesh passed to fully_shard, but got different mesh objects`. The same program in a fresh
process, or on a shape the process has not met so, trains. (The mechanism, equal meshes sharing
cache entries, is the one transformers met with two TP models in one process:
huggingface/transformers#48383.)

- **Caught by:** tpdp-verify's own tests: a case in the SPMD form failed only after a case with TP
  under the FSDP2-based replicate had run on the same ranks (tests/test_exclusions.py); and its
  reproduction. The gate's ranks take many cases, so where the SPMD form's parameters come back
  holding another mesh, the harness empties DTensor's caches and makes them again on the mesh itself,
  as a fresh process has them (tpdp_verify/ranks/tp_dp.py; tests/test_training.py): no case's
  verdict depends on the cases before it.""",
    consequence="""a process that trains or evaluates TP under FSDP2 and then builds a model in the SPMD
  form on an equal mesh (a test suite, a notebook, a trainer that rebuilds its model) cannot wrap it:
  `fully_shard` raises, though the parameters were made on the mesh it is given.""",
    workaround="""build the SPMD-form model first in the process, or empty DTensor's caches before making its
  parameters (`torch.distributed.tensor.debug._clear_sharding_prop_cache()`).""",
    fix="compare the parameter's mesh with the one given by equality, as DTensor does",
    entry_points=("fully_shard", "replicate_fsdp"),
    apis=("torch.distributed.fsdp.fully_shard", "torch.distributed.tensor.distribute_tensor"),
    source=("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharding_spec_spmd",
            "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharding_spec_tp"),
    shows=(),
    repro="f42_spmd_fully_shard_refuses_an_equal_mesh.py",
    upstream=(),
),
)
