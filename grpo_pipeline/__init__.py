"""grpo-pipeline: GRPO (DeepSeekMath) training as DVC stages."""
