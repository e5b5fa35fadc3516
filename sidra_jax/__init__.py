"""sidra_jax: JAX and Flax functions on the SIDRA chip (the same sidra_core device model)."""
