"""A hang with no heartbeat: ranks with uneven inputs and no ``join``, each waiting in a collective.

Rank R trains ``5 + R`` batches under DDP. Rank 0 finishes first and waits in the barrier of
``wait_for_everyone()``; rank 1's extra backward waits for a gradient all-reduce that rank 0 never
joins. Measured on CPU (gloo): both wait forever, under ``torchrun`` as under orchestrator, the
same hang accelerate's own ``test_distributed_data_loop.py`` shows on CPU (see FIELD_NOTES.md).
Used by the watchdog tests: ``status`` must show the silence and ``orchestrator stacks`` every rank
inside a collective.
"""

import torch
from accelerate import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(5 + accelerator.process_index):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank {accelerator.process_index} step {step}", flush=True)
print(f"rank {accelerator.process_index} out of data: waiting for everyone", flush=True)
accelerator.wait_for_everyone()
print(f"rank {accelerator.process_index} passed the barrier (not expected)", flush=True)
