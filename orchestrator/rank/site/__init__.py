"""Put on ``PYTHONPATH`` of the training processes by the node entry point (see ``sitecustomize``)."""
