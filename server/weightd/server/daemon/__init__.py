"""Assembly: the listeners, security policy, lifecycle and metric collectors of one daemon.

The only stage that sees every other one: it builds them, wires them and runs them.
"""
