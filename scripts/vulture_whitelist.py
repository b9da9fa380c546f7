"""Names vulture (scripts/lint.sh) cannot see used: each is read by a framework, a protocol or a decoder, not
by our own code. Add a name here only with the reason; dead code is deleted instead."""
# ruff: noqa: B018, F821

# entry points (pyproject [project.entry-points]) and protocol methods their frameworks call
ADAPTER  # the steptap.adapters entry point of each frameworks/*.py
_.get_model  # openai-agents' ModelProvider interface
_.async_anthropic_client  # public Session API (docs/protocols.md)
exc_type, tb  # __exit__ / __aexit__ signatures

# verl's Platform / torch device-module interface, implemented for CPU (learner/engines/verl_cpu.py)
_.empty_cache, _.mem_get_info, _.reset_peak_memory_stats, _.set_per_process_memory_fraction, _.ipc_collect
_.get_device_name, _.vendor_name, _.device_module, _.device_count, _.set_device, _.manual_seed_all
_.set_allocator_settings, _.get_device_capability, _.visible_devices_envvar, _.nvtx_range, _.profiler_start
_.profiler_stop, _.ray_noset_envvars, _.is_ipc_supported, _.cudart
manual_seed_all, max_memory_reserved, memory_allocated, memory_reserved, use_smi_check, device_index, num_gpus

# attributes set on library objects (tokenizers, transformers configs, torch.distributed options)
_.use_cache, _.normalizer, _.pre_tokenizer, _.decoder, _.architectures, _.rootRank, _._timeout, _.__cause__

# vLLM's weight-transfer engine interface (launch/vllm_plugin/, loaded by vLLM through its plugin entry point)
SteptapTransferEngine, init_info_cls, update_info_cls, supports_draft_weight_update
_.init_transfer_engine, _.trainer_send_weights, iterator, trainer_args

# msgspec Struct fields: decoded, validated and written, never read by name
max_completion_tokens, top_logprobs, return_token_ids, echo  # proxy/validate.py: checked at the edge
finished_at  # records.Trajectory: part of the record the learner and export read
mime  # records.ImageRef: part of the record (the image bytes' type, for readers and export)
logprob  # proxy/replies._Logprob: read by name through operator.attrgetter (a C loop a reply)


# aiohttp's Payload interface (backend/client.py: Parts): called by aiohttp's client, never by name here
_.as_bytes, _.write_with_length
