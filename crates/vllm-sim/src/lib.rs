//! vLLM simulator.
