"""An OpenAI-compatible endpoint over the sampler fleet, recording exact tokens per session.

    agent (openai client) ──HTTP──► app.py ──► ServeCore ──► fleet.generate(session, request)
                                                  │
                                        conversation.py: session id -> recorded tokens

``mixrl serve MODEL`` runs it standalone (a local server on one sampler group);
inside a run, agent environments (``env.name = "openai_agent:..."``) sample
through it, and each session's record becomes a training trajectory with the
behaviour log-prob, version and group of every generated token.
"""
