"""Model architectures: LLM backbone (dense or MoE), vision and audio encoders, projectors, OmniModel, flavor
registry, parameter/FLOP counts (`flops`) and HF safetensors import/export (`hf_import`).

Nothing is imported here: the flavor registry (`flavors`), the model arguments (`args`) and the counts
(`flops`) import without torch, so a launch check reads a flavor without loading it; the modules (`omni`,
`attention`, ...) are imported from where they are defined."""
