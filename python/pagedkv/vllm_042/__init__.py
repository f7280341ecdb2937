"""pagedkv for vLLM 0.4.2's generation (the V0-era API): the code behind the package root's
names (``from pagedkv import Sequence, BlockSpaceManager, Scheduler, ...``).

* :mod:`.sequence`, :mod:`.block`, :mod:`.types`, :mod:`.outputs`: vLLM's ``vllm/sequence.py``,
  ``vllm/block.py``, ``SamplingParams``/``Logprob``/``LoRARequest`` and the sampler outputs;
* :mod:`.block_manager`: ``BlockSpaceManager`` (BlockSpaceManagerV1 semantics), over the
  native manager; :mod:`.protocols`: what it reads from a sequence and a group;
* :mod:`.scheduler`: ``Scheduler`` (vLLM 0.4.2's ``vllm/core/scheduler.py``);
  :mod:`.engine_step`: the one-call batch engine step; :mod:`.demo_paths`: the demo's two
  ways of driving the scheduler;
* :mod:`.reference`: the pure-Python oracle (block pool, block manager, sequence, hashing).

The old module paths (``pagedkv.sequence``, ``pagedkv.block``, ``pagedkv.block_manager``,
``pagedkv.scheduler``, ``pagedkv.engine_step``, ``pagedkv.types``, ``pagedkv.outputs``,
``pagedkv.protocols``, ``pagedkv.demo_paths``, ``pagedkv.reference``) re-export these modules'
names, the same objects. vLLM's v1 engine is :mod:`pagedkv.vllm_v1`.
"""
