"""The route decorator and what it builds: `guard_route`, the endpoint that runs a handler inside
its guards and answers with the envelope or a public error (and which model answered, in its
headers), the task endpoint, the 400 of input that never reached a handler, the OpenAPI
additions, the body limit, effort routing and the downgrade near a cap. Imports every layer
below it, `guards.walk` included; only the facade (`guards._guards`) imports it.
"""

__all__: list[str] = []
