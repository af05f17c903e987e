"""Exchange with other stacks: pivot sets exported as NeMo Gym / NeMo RL rows
(:mod:`~pivotrl.interop.export`) and a trained policy served by vLLM's OpenAI-compatible server
(:mod:`~pivotrl.interop.serving`)."""
