"""The forward pass: the kernel, the batched and streamed attention, inputs, devices, the
results."""
