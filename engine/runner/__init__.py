"""One device's model: loading it under the memory layer, running a step's forward (the model runner),
the KV policy between steps, checkpoint orders, and the step executor."""
