"""Commands from a laptop, run on the cluster's login host over SSH (a profile's ``login:`` key).

A remote profile is the API's calls carried over one connection: the laptop runs the login host's
own orchestrator (``agent``) through OpenSSH (``ssh``: one authentication reused through a
ControlMaster, never a prompt), sends the code snapshot it submits (``snapshot``), and keeps a
small book of the jobs it started there and of their final rows (``book``). ``client`` is what
the command line and the API call.
"""
