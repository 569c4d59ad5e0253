"""Megatron-core torch_dist checkpoints: the run directory and its iter_*/ saves, the
distributed optimizer's buckets, the GPT <-> Hugging Face mapping (plan), and a save read as
the HF model's training checkpoint (training)."""

from __future__ import annotations

import re

#: the layouts this package defines: (name, module, detection priority; lower first): a run
#: directory and its iter_*/ saves hold DCP data, so before "dcp"
LAYOUTS = (
    ("megatron", "layout", 14),
    # NeMo 2 (weights/ + context/) and Megatron-Bridge (iter_*/ with run_config.yaml): Megatron
    # saves in their writers' directories, so before "megatron" (module nemo)
    ("nemo2", "nemo", 12),
    ("megatron_bridge", "nemo", 13),
)
#: ``shard --to NAME``: this package's writer module, which plans a save in its layout
WRITE_TARGETS = (("megatron", "writer"),)
#: What Megatron-core's ``common_state`` and ``rng_state`` objects name beside plain training
#: state: Megatron's own ``safe_globals.SAFE_GLOBALS`` (what it admits with
#: ``weights_only=True``), read as data (formats.safe_pickle.admit): enums as values, its
#: optimizer config dataclass as a record
PICKLE_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)
PICKLE_RECORDS = ("megatron.core.optimizer.optimizer_config.OptimizerConfig",)
#: its layouts whose stored names are not the model's (their ``views`` convert them)
VIEWED = ("nemo2", "megatron_bridge", "megatron")  # in detection order

#: Megatron-LM ``iter_0000010`` (7 digits at least)
ITER_SAVE = re.compile(r"^iter_(\d{7,})$")
#: the run's record of its last save (``iter_*`` or ``release``)
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: ``Manifest.details`` keys of a save's run facts (``layout.RunArgs`` as a dict) and of how
#: many entries each part of it holds (model, optimizer, rng, common...)
DETAILS_KEY, PARTS_KEY = "megatron", "megatron_parts"
#: the modules of what ``inspect`` shows of this family's checkpoints (``KEY``, ``facts``,
#: ``lines``: :func:`ckptools.producers.registry.inspected`)
FACTS = ("megatron.facts",)
#: the module whose ``iteration_dir(run, n)`` is iteration ``n``'s save of a run (``--iteration``)
ITERATIONS = ("megatron.layout",)
#: what the CLI's help says of this family, by the place it goes
#: (:func:`ckptools.cli.options.producers_say`): its own words, the one place they are written
HELP = (
    ("reads", ("Megatron-core torch_dist",
               "ckpt consolidate megatron_run hf_model")),
    ("reads", ("NeMo 2, Megatron-Bridge", "ckpt consolidate nemo_run/checkpoints hf_model")),
    ("consolidate --masters",
     "Megatron save: write the distributed optimizer's fp32 masters instead of the stored "
     "model weights (bf16 runs keep fp32 masters there)."),
    ("consolidate examples",
     "ckpt consolidate megatron_run hf_model --masters --config hf_config_dir"),
    # a Megatron-core run loads at any TP / PP: the world size only says how many rank files
    ("shard --world-size",
     "for --to megatron, how many rank files hold the bytes, default 1: Megatron loads them at "
     "any TP / PP"),
    ("shard --to",
     "megatron: a Megatron-core torch_dist run directory "
     "(latest_checkpointed_iteration.txt + iter_0000001/) from a Llama-family, Mixtral, "
     "Qwen3-MoE or DeepSeek-V3 (MLA) model."),
    ("shard --make-vocab-size-divisible-by",
     "--to megatron: pad the vocabulary to a multiple of this (Megatron-LM's option of that "
     "name times the tensor-parallel size it will load with)."),
    ("shard examples", "ckpt shard ./Llama-3-8B megatron_run --to megatron"),
    ("list saves", ("Megatron and Megatron-Bridge", "iter_0000010")),
    ("list saves", ("NeMo 2", "<name>--...-step=N-... in checkpoints/")),
    ("--iteration",
     "Read iteration N of a Megatron run directory (iter_000000N/) instead of the one "
     "latest_checkpointed_iteration.txt names."),
)  # fmt: skip
#: NeMo 2's checkpoint directories (``<name>--...-step=<N>-...``, ModelCheckpoint's ``{step}``);
#: never ``.ckpt`` (NeMo's ``ckpt_to_dir`` drops Lightning's suffix), which is Lightning's own
#: sharded checkpoint folder (``epoch=0-step=2.ckpt/``), not a NeMo save
NEMO_SAVE = re.compile(r"^(?!.*\.ckpt$).*\bstep=(\d+)(?!\d).*$")
SAVES = (ITER_SAVE, NEMO_SAVE)
#: Megatron-Bridge's record of its last save, beside the tracker file
BRIDGE_RECORD = "latest_train_state.pt"
RUN_RECORDS = (TRACKER_FILE, BRIDGE_RECORD)
#: what ``--masters`` takes from a save of this family (its views' ``with_masters``)
MASTERS = ("a Megatron distributed optimizer's fp32 masters",)
#: the model ``--masters`` exports from it (which LoRA options and ``--select`` do not apply to)
MASTERS_MODEL = ("a Megatron model",)
PARTS = (
    # a save's marker and a run's tracker: never a checkpoint alone
    (re.compile(r"^metadata\.json$"), "megatron"),
    (re.compile(r"^latest_checkpointed_iteration\.txt$"), "megatron"),
    # Megatron-Bridge's side files of a save and of its run
    (re.compile(r"^(latest_)?train_state\.pt$"), "megatron_bridge"),
    (re.compile(r"^run_config\.yaml$"), "megatron_bridge"),
)
