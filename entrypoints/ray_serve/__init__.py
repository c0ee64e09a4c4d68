"""The engine on Ray Serve (``pip install engine[ray]``; docs/ray.md): prefill and decode
deployments of real engine instances behind an OpenAI ingress, which Ray places, health-checks,
restarts and autoscales. Nothing here is imported unless Ray is used."""
