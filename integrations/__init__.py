"""gradwatch in the training frameworks: one line each, attaching the agent where the framework
keeps the model and optimizer that really train.

    from gradwatch.integrations.hf import GradwatchCallback          # Hugging Face Trainer
    Trainer(..., callbacks=[GradwatchCallback()])

    from gradwatch.integrations.lightning import GradwatchCallback   # Lightning
    L.Trainer(..., callbacks=[GradwatchCallback()])

    from gradwatch.integrations.accelerate import attach             # accelerate
    monitor = attach(accelerator, model, optimizer)                  # after accelerator.prepare

Each attaches to the DDP-wrapped model and the optimizer inside the framework's wrapper, reports
the loss the framework logs (never divided by gradient accumulation), numbers steps as the
framework does where it numbers them, says once when the framework clips gradients, and closes
the agent when training ends. Keyword arguments are agent settings (``gradwatch.agent.attach``).
The frameworks are imported only by their own module: none is a dependency of gradwatch.
"""
