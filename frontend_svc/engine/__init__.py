"""The engine client: one bidi stream per engine, a handle per request, routing over the
engines. Only the protobuf conversion (convert.py), the channel (channel.py) and the
session that opens the streams (client.py) know the engine protocol; what they hand to
the rest of the frontend are the plain values of frontend_svc/types.py."""
